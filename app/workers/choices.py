"""The precision each export serves in under ``MB_DTYPE=auto``, decided in one place
(``PrecisionChoice``) for a pool and for a broker fleet, and so the id its answers carry.

The first worker to load an export measures the candidates and records what it chose, for
the others (its ``FleetRecord``: a pool's own decisions, or Redis for a broker fleet,
``app.broker.wire.control.Precisions``), which then load it in that one: one id per export.
Its choice is also kept under the host's class (its CPU model, the instruction sets that
decide bf16, the versions of torch and OpenVINO: ``host_class``) in
``MB_STATE_DIR/precisions.json`` (``HostChoices``): the next first load on such a host (a
restart, or a fleet whose Redis lost its record) measures again, but keeps that precision
unless another is decisively faster (``app.workers.runtimes.DECISIVE``), and then says so.

No torch here: the HTTP process decides for its pool.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Protocol

from app.lifecycle import ModelSpec
from app.manifest import served_model_id, split_served_id

log = logging.getLogger("app.worker")

FILE_NAME = "precisions.json"
# The CPU flags that decide which precisions a host computes natively.
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")


def host_class(cpuinfo: str | None = None) -> str:
    """What makes two hosts measure alike, as 12 hex: CPU model, the flags of ``FLAGS`` it
    has, the machine, and the versions of torch and OpenVINO.

    >>> a = host_class("model name\\t: Xeon\\nflags\\t\\t: fpu avx2 avx512f")
    >>> a == host_class("model name\\t: Xeon\\nflags\\t\\t: avx512f fpu avx2 sse")
    True
    >>> a == host_class("model name\\t: Xeon\\nflags\\t\\t: fpu avx2 avx512f avx512_bf16")
    False
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = "", set[str]()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    versions = []
    for package in ("torch", "openvino"):
        try:
            versions.append(f"{package}={metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package}=none")
    described = [platform.machine(), model, *sorted(flags & set(FLAGS)), *versions]
    return hashlib.sha256("\n".join(described).encode()).hexdigest()[:12]


class HostChoices:
    """The precisions chosen on this host class, by export (model id), in ``folder``
    (``MB_STATE_DIR``; None: kept in memory only). A folder that cannot be written is said
    once, and the choices are kept in memory then.

    >>> # choices = HostChoices(Path("/var/lib/microbatch"))
    >>> # choices.recorded("efficientnet_lite0@53996b4318c6")   # "bfloat16", or None
    >>> # choices.record("efficientnet_lite0@53996b4318c6", "bfloat16")
    """

    def __init__(self, folder: Path | None, host: str | None = None) -> None:
        self.folder = folder
        self.host = host or host_class()
        self._memory: dict[str, str] = {}
        self._warned = False

    @property
    def path(self) -> Path | None:
        return self.folder / FILE_NAME if self.folder is not None else None

    def _read(self) -> dict[str, dict[str, str]]:
        path = self.path
        if path is None or not path.is_file():
            return {}
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        return {
            host: {k: v for k, v in entries.items() if isinstance(v, str)}
            for host, entries in data.items()
            if isinstance(entries, dict)
        }

    def recorded(self, model_id: str) -> str | None:
        """The precision chosen for ``model_id`` on this host class before, if any."""
        if model_id in self._memory:
            return self._memory[model_id]
        return self._read().get(self.host, {}).get(model_id)

    def record(self, model_id: str, dtype: str) -> None:
        """Keep ``dtype`` as the precision of ``model_id`` on this host class."""
        self._memory[model_id] = dtype
        path = self.path
        if path is None:
            return
        data = self._read()
        if data.get(self.host, {}).get(model_id) == dtype:
            return
        data.setdefault(self.host, {})[model_id] = dtype
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Written aside, then renamed into place: a reader never sees half a file.
            handle, staged = tempfile.mkstemp(dir=path.parent, prefix=".precisions-")
            with os.fdopen(handle, "w") as out:
                json.dump(data, out, indent=1, sort_keys=True)
            os.replace(staged, path)
        except OSError as exc:
            with contextlib.suppress(OSError, UnboundLocalError):
                os.unlink(staged)
            if not self._warned:
                self._warned = True
                log.warning(
                    "MB_STATE_DIR=%s cannot be written (%s): the precision chosen for each "
                    "export is kept in memory only, and measured again at the next start",
                    self.folder,
                    exc,
                )


class FleetRecord(Protocol):
    """The precision each export is served in by the workers that share it (a pool, a
    broker fleet): the first to record one wins."""

    def read(self, model_id: str) -> str | None: ...

    def record(self, model_id: str, dtype: str) -> str:
        """Record ``dtype`` unless another was first: the one recorded."""


class PoolRecord:
    """A pool's ``FleetRecord``: its workers share one host (and this process)."""

    def __init__(self) -> None:
        self.dtypes: dict[str, str] = {}

    def read(self, model_id: str) -> str | None:
        return self.dtypes.get(model_id)

    def record(self, model_id: str, dtype: str) -> str:
        return self.dtypes.setdefault(model_id, dtype)


class PrecisionChoice:
    """Where the id a version serves under is decided: ``decided`` gives the spec a worker
    loads (the fleet's precision for its export, else ``auto`` to be measured with this host
    class's earlier choice as the incumbent), ``record`` keeps what a measuring load chose
    (and says which precision to load instead, where another worker recorded first).
    ``computes``: whether the worker can compute a precision (a host without bf16 units
    serves fp32 under an id of its own, and says so).

    >>> choice = PrecisionChoice(PoolRecord(), HostChoices(None, host="h"))
    >>> spec = ModelSpec("t", 1, "/m/t/1", "tiny@abc", dtype="auto")
    >>> choice.decided(spec).dtype, choice.record(spec, spec.decided("bfloat16", "tiny@abc+bf16"))
    ('auto', None)
    >>> choice.decided(spec).served_id
    'tiny@abc+bf16'
    """

    def __init__(
        self,
        fleet: FleetRecord,
        host: HostChoices,
        computes: Callable[[str], bool] = lambda dtype: True,
    ) -> None:
        self.fleet = fleet
        self.host = host
        self.computes = computes
        self.known: dict[str, str] = {}  # export -> the fleet's precision, as read or written
        self.unrecorded: dict[str, str] = {}  # export -> the precision a load chose, unsaid

    def restore(self) -> None:
        """Write again the fleet's precisions this worker knows, where the record lost them
        (a Redis failover loses what did not reach a replica); never over another. Raises
        what the fleet's record raises."""
        self.settle()
        for model_id, dtype in list(self.known.items()):
            self.fleet.record(model_id, dtype)

    def settle(self) -> None:
        """Record the choices the fleet's record could not take when they were made (Redis
        away): before, the next worker to load the export measured again, and might serve
        it under another id. Raises what the fleet's record raises."""
        for model_id, dtype in list(self.unrecorded.items()):
            fleet = self.fleet.record(model_id, dtype)
            del self.unrecorded[model_id]
            if self.computes(fleet):
                self.known[model_id] = fleet
            if fleet != dtype:
                log.warning("%s: another worker recorded %s for the fleet while this one "
                            "could not record %s; this one serves its own until the next "
                            "load", model_id, fleet, dtype)  # fmt: skip

    def decided(self, spec: ModelSpec) -> ModelSpec:
        """``spec`` as a worker loads it. Raises what the fleet's record raises (Redis)."""
        if spec.dtype != "auto":
            return spec
        model_id = split_served_id(spec.served_id)[0]
        fleet = self.fleet.read(model_id)
        if fleet is not None and not self.computes(fleet):
            log.warning(
                "%s is served in %s by the fleet; this host cannot compute it, and serves it "
                "in float32, under an id of its own (set MB_DTYPE fleet-wide on mixed CPUs)",
                model_id,
                fleet,
            )
            fleet = "float32"
        if fleet is not None:
            self.known[model_id] = fleet
            return spec.decided(fleet, served_model_id(model_id, fleet))
        return spec.with_incumbent(self.host.recorded(model_id))

    def record(self, requested: ModelSpec, loaded: ModelSpec) -> ModelSpec | None:
        """After a load that chose its precision (``requested`` was ``auto``): keep it for
        the fleet and this host class; if another worker recorded another one first, that
        one, to load instead (None: keep what loaded)."""
        if requested.dtype != "auto":
            return None
        model_id = split_served_id(loaded.served_id)[0]
        try:
            fleet = self.fleet.record(model_id, loaded.dtype)
        except Exception:  # recorded later (settle); this worker serves what it loaded
            self.unrecorded[model_id] = loaded.dtype
            self.host.record(model_id, loaded.dtype)
            raise
        if self.computes(fleet):
            self.known[model_id] = fleet
        if fleet == loaded.dtype or not self.computes(fleet):
            self.host.record(model_id, loaded.dtype)
            return None
        log.info("%s: the fleet serves it in %s: loading it so", model_id, fleet)
        self.host.record(model_id, fleet)
        return requested.decided(fleet, served_model_id(model_id, fleet))
