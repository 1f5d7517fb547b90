"""A model worker: tune the process, load the models it is given, then run batches (and load
or unload models between them) until told to stop.

``worker_main`` is the entry point of the pool's worker processes (started with ``spawn`` by
``app.workers.pool``; they talk over one socket, see ``app.workers.channel``, and receive
images through their shared buffer, see ``app.workers.transfer``). ``PreparedWorker`` is the
part any worker process runs, whatever feeds it batches (the broker's consumer too): it holds
every model the worker serves, by served id, so one process (and its cores) serves several
models and versions, and it owns their loading and unloading. Both run a batch with one
function, ``app.workers.compute.run_batch``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from app.batching import Trial
from app.errors import ContentMismatch, WorkerStartError
from app.lifecycle import ModelSpec
from app.manifest import Manifest, read_manifest, split_served_id
from app.plan import WorkerConfig
from app.settings_values import byte_unit, in_unit
from app.workers.allocator import (
    ResidentBound,
    anonymous_bytes,
    release_freed_memory,
    retain_freed_memory,
)
from app.workers.decoding import Decoder, DeviceDecoder
from app.workers.messages import (
    ModelLoaded,
)
from app.workers.models import LoadOptions
from app.workers.runner import BatchRunner, choose_batch_size
from app.workers.runtimes import candidate_dtypes, choose_runtime, cpu_has_bf16

log = logging.getLogger("app.worker")

MB = 1 << 20


class LoadFailure(Exception):
    """A model could not be loaded, at ``step``: verify, load, self-test, warm-up or budget.
    Nothing of it stays in the worker."""

    def __init__(self, spec: ModelSpec, step: str, message: str) -> None:
        super().__init__(message)
        self.spec = spec
        self.step = step
        self.message = message

    def describe(self) -> str:
        return f"{self.spec.name} version {self.spec.version}: {self.step}: {self.message}"


@dataclass
class PreparedModel:
    """One model a worker holds: loaded, self-tested, warmed up and measured; the runtimes
    that failed their self-test or load for it (``skipped``, with why), and how many times
    slower than the fastest of those its export measured it runs (``slowdown``)."""

    spec: ModelSpec
    runner: BatchRunner
    decoder: Decoder | DeviceDecoder | None
    batch_size: int  # the largest batch it wants: its auto choice, or the maximum
    throughput: dict[int, float] = field(default_factory=dict)  # auto: images/s per size
    memory_bytes: int = 0  # what it costs this worker: measured growth, at least its files
    skipped: dict[str, str] = field(default_factory=dict)
    slowdown: float | None = None
    trials: tuple[Trial, ...] = ()  # the runtimes and precisions tried, with their figures

    @property
    def report(self) -> ModelLoaded:
        return ModelLoaded(
            self.spec.served_id,
            self.batch_size,
            self.runner.models.runtime,
            self.memory_bytes,
            self.throughput,
            name=self.spec.name,
            version=self.spec.version,
            skipped=tuple(self.skipped.items()),
            slowdown=self.slowdown,
            dtype=self.spec.dtype,
            trials=self.trials,
        )

    @property
    def advertised(self) -> dict[str, Any]:
        """What a broker worker's heartbeat says of it, beside its name and state."""
        return {
            "runtime": self.runner.models.runtime,
            "batch_size": self.batch_size,
            "memory_bytes": self.memory_bytes,
            "skipped": {name: reason[:300] for name, reason in self.skipped.items()},
            "slowdown": self.slowdown,
            "dtype": self.spec.dtype,
            "trials": [asdict(trial) for trial in self.trials],
        }

    def close(self) -> None:
        if self.decoder is not None:
            self.decoder.close()


def _configure_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # already set (only possible in-process)
        torch.set_num_interop_threads(1)


def model_file_bytes(store: Path, manifest: Manifest) -> int:
    """The bytes of the model files a worker may load from ``store`` (TorchScript, which it
    always loads as the self-test's reference, and every derived runtime's): a model's
    least cost, known before loading it."""
    entries = [entry for role, entry in manifest.files.items() if role != "classes"]
    for artifact in manifest.runtimes.values():
        entries += artifact.files.values()
    total = 0
    for entry in entries:
        with contextlib.suppress(OSError):
            total += (store / entry.path).stat().st_size
    return total


class PreparedWorker:
    """A worker process's device and threads, and the models it holds by served id.

    >>> # worker = PreparedWorker(config, "cpu", threads=2)
    >>> # worker.load(ModelSpec("tagger", 2, "models/tagger/2", "resnet50@1a2b3c4d5e6f"))
    >>> # worker.model("resnet50@1a2b3c4d5e6f").runner.run(Task.TAG, pixels, 5)
    >>> # worker.unload("resnet50@1a2b3c4d5e6f")   # its memory goes back to the kernel
    """

    def __init__(
        self, config: WorkerConfig, device_name: str, threads: int, load_delay_s: float = 0.0
    ) -> None:
        retain_freed_memory()  # first: every allocation after it benefits
        _configure_threads(threads)
        self.config = config
        self.threads = threads
        # Testing only (MB_TEST_LOAD_DELAY_S): each load sleeps this long, on purpose.
        self.load_delay_s = load_delay_s
        self.device = torch.device(device_name)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.models: dict[str, PreparedModel] = {}
        # Its memory's level once warmed up; serving loops call after_batch() once answered.
        self.memory = ResidentBound()

    @property
    def held_bytes(self) -> int:
        # list(): one step under the GIL, while a load in another thread reads this
        return sum(model.memory_bytes for model in list(self.models.values()))

    def own_thread(self) -> None:
        """Run torch on the calling thread (a loader's) with this worker's thread count:
        each thread has its own OpenMP settings."""
        _configure_threads(self.threads)

    def hold(self, prepared: PreparedModel) -> None:
        """Serve ``prepared`` from now on (a model ``load(..., hold=False)`` prepared in
        another thread: only the thread that runs batches changes what they see)."""
        self.models[prepared.spec.served_id] = prepared
        self.memory.settle()

    def model(self, served_id: str) -> PreparedModel:
        """The model a batch names; ``KeyError`` with a message if this worker lacks it."""
        try:
            return self.models[served_id]
        except KeyError:
            raise KeyError(f"this worker holds no model {served_id!r}") from None

    def load(
        self, spec: ModelSpec, *, hold: bool = True, delay_s: float | None = None
    ) -> PreparedModel:
        """Verify, load, self-test and warm up ``spec`` beside the models held, and with
        ``hold`` serve it from now on; raises ``LoadFailure`` (saying at which step) and then
        holds nothing of it. Without ``hold`` it may run in a thread of its own while batches
        run: the caller's ``hold`` puts it in service. ``delay_s`` (testing only): sleep
        this long in it (None: ``load_delay_s``)."""
        if spec.served_id in self.models:
            return self.models[spec.served_id]
        store = Path(spec.store)
        try:
            manifest = read_manifest(store, verify=True)  # every sha256, once
        except Exception as exc:
            raise LoadFailure(spec, "verify", str(exc)) from None
        if manifest.model_id != split_served_id(spec.served_id)[0]:
            raise LoadFailure(
                spec,
                "verify",
                f"{store} now holds {manifest.model_id}, not {spec.served_id}: a version "
                "folder must not change once published",
            )
        least = model_file_bytes(store, manifest)
        self._check_budget(spec, least, "its model files")
        release_freed_memory()
        before = anonymous_bytes()
        try:
            delay = self.load_delay_s if delay_s is None else delay_s
            prepared = self._prepare(spec, store, manifest, delay)
        except LoadFailure:
            release_freed_memory()
            raise
        release_freed_memory()
        prepared.memory_bytes = max(anonymous_bytes() - before, least)
        try:
            self._check_budget(spec, prepared.memory_bytes, "measured once loaded")
        except LoadFailure:
            prepared.close()
            del prepared
            release_freed_memory()
            raise
        if hold:
            self.hold(prepared)
        log.info(
            "loaded %s version %d (%s) on %s with %s: %d MB",
            spec.name,
            spec.version,
            prepared.spec.served_id,
            self.device,
            prepared.runner.models.runtime,
            prepared.memory_bytes // MB,
        )
        return prepared

    def computes(self, dtype: str) -> bool:
        """Whether this worker computes ``dtype`` natively (bf16 needs bf16 units on a CPU)."""
        if dtype != "bfloat16" or self.device.type != "cpu":
            return True
        return cpu_has_bf16() if self.config.bf16_units is None else self.config.bf16_units

    def _check_budget(self, spec: ModelSpec, needs: int, how: str) -> None:
        budget = self.config.memory_budget_bytes
        held = self.held_bytes
        if budget is not None and held + needs > budget:
            unit = byte_unit(budget)  # every figure in the unit the setting was written in
            raise LoadFailure(
                spec,
                "budget",
                f"it needs {in_unit(needs, unit)} ({how}) and the models loaded hold "
                f"{in_unit(held, unit)}: {in_unit(held + needs, unit)} is over "
                f"MB_MODEL_MEMORY={in_unit(budget, unit)}",
            )

    def _prepare(
        self, spec: ModelSpec, store: Path, manifest: Manifest, delay_s: float
    ) -> PreparedModel:
        config, device = self.config, self.device
        bf16 = self.computes("bfloat16")
        dtypes = candidate_dtypes(manifest, spec.dtype, device, bf16)
        options = LoadOptions(
            dtype=getattr(torch, dtypes[0]),
            optimize=config.optimize,
            threads=self.threads,
            # The lone request's size, and the full batch's (under auto, the size it
            # chooses is not known until measured: the lone one only).
            static_batches=(1,) if config.auto_batch else (1, config.max_batch_size),
        )
        try:
            if delay_s:  # testing only: a slow load, on purpose
                time.sleep(delay_s)
            choice = choose_runtime(
                store, device, options, config.runtime, manifest,
                [getattr(torch, dtype) for dtype in dtypes], bf16,
                getattr(torch, config.fastest_dtype) if config.fastest_dtype else None,
                getattr(torch, spec.incumbent) if spec.incumbent else None,
            )  # fmt: skip
        except WorkerStartError as exc:  # a runtime refused by its self-test, or absent
            raise LoadFailure(spec, "self-test", str(exc)) from None
        except ContentMismatch as exc:
            raise LoadFailure(spec, "verify", str(exc)) from None
        except Exception as exc:
            raise LoadFailure(spec, "load", f"{type(exc).__name__}: {exc}") from None
        dtype = str(choice.dtype).removeprefix("torch.")
        spec = spec.decided(dtype, manifest.served_id(dtype))
        if choice.images_per_s:
            log.info(
                "%s on %s: %s in %s serves, as %s (%s)",
                spec.name,
                device,
                choice.models.runtime,
                dtype,
                spec.served_id,
                choice.describe(),
            )
        runner = BatchRunner(choice.models, device)
        decoder: Decoder | DeviceDecoder | None = None
        prepared = PreparedModel(
            spec,
            runner,
            decoder,
            config.max_batch_size,
            skipped=dict(choice.skipped),
            slowdown=choice.slowdown,
            trials=tuple(choice.trials.values()),
        )
        try:
            if config.decode_threads:
                spec_in = choice.models.manifest.input
                prepared.decoder = Decoder(spec_in, config.decode_threads, config.max_pixels)
                if config.decode_on_device:
                    prepared.decoder = DeviceDecoder(
                        spec_in, device, prepared.decoder, config.max_pixels
                    )
                    prepared.decoder.warm_up()
            if config.auto_batch:  # measuring runs every size up to the one it chooses
                runner.warm_up()
                prepared.batch_size, prepared.throughput = choose_batch_size(
                    runner, runner.image_shape, config.max_batch_size
                )
            else:
                runner.warm_up(largest=config.max_batch_size)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as exc:
            prepared.close()
            raise LoadFailure(spec, "warm-up", f"{type(exc).__name__}: {exc}") from None
        return prepared

    def unload(self, served_id: str) -> None:
        """Drop a model and hand its memory back to the kernel (a no-op if not held)."""
        prepared = self.models.pop(served_id, None)
        if prepared is None:
            return
        prepared.close()
        del prepared
        release_freed_memory()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.memory.settle()
        log.info("unloaded %s from %s", served_id, self.device)


def start_failure(exc: BaseException) -> str:
    """What a worker that cannot start says about it."""
    if isinstance(exc, LoadFailure):
        return exc.describe()
    return f"{type(exc).__name__}: {exc}"
