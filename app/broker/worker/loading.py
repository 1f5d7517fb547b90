"""What a broker worker loads, and its loads: each in a thread of its own, so the worker goes
on running batches of the versions it serves while a new one loads, self-tests and warms up;
one worker per host loading at a time, under a lock in Redis, so a host's cores serve while
one of them loads.

When asked (``SIGHUP``, ``MB_REPOSITORY_POLL_S``, or the admin route through Redis:
``app.broker.wire.control``), the ``Loader`` reads which version each name should serve
(``app.lifecycle.chosen_version``) and queues the loads of those the worker lacks. A load
that passes its deadline (``MB_WORKER_START_TIMEOUT``) is given up: the worker advertises it
failed (step ``timeout``) and goes on; the thread, which cannot be stopped, is left to
finish, and what it loaded is dropped then.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import redis
from redis.exceptions import RedisError

from app.broker.wire.control import PinReader, Precisions
from app.broker.wire.keys import Keys
from app.broker.wire.live import LiveView
from app.errors import ModelStoreError
from app.lifecycle import LOADERS_PER_HOST, ModelSpec, given_up
from app.manifest import read_manifest, served_model_id, split_served_id
from app.repository import Repository
from app.workers.loading import Loading
from app.workers.process import PreparedModel, PreparedWorker

log = logging.getLogger("app.worker")

UNKNOWN = -1  # a name whose target cannot be read (gone from disk): keep what serves it
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Versions(Protocol):
    """What a ``Loader`` asks and tells of the versions it loads for: its worker's
    ``WorkerVersions`` (``app.broker.worker.versions``), which owns their lives."""

    def aim(self, targets: dict[str, int | None]) -> None:
        """The version each name should serve now (None: unloaded; ``UNKNOWN``: cannot be
        read)."""

    def holds(self, served_id: str) -> bool: ...

    def number_of(self, served_id: str) -> int: ...

    def has_failed(self, name: str, version: int) -> bool: ...

    def forget_failures(self, name: str) -> None:
        """A retry (``SIGHUP``, the admin route): ``name``'s failures are tried again."""

    def renumber(self, spec: ModelSpec) -> None:
        """The export held serves under ``spec``'s number from now on."""

    def begin(self, spec: ModelSpec) -> None:
        """A load of ``spec`` starts (in the loader's thread)."""

    def forget(self, spec: ModelSpec) -> None:
        """A load whose result is dropped (to load it in another precision)."""

    def loaded(self, requested: ModelSpec, model: PreparedModel, seconds: float) -> None:
        """The load of ``requested`` ended well: the model serves from now on."""

    def fail(self, spec: ModelSpec, step: str, reason: str) -> None:
        """A load failed (or passed its deadline): the version is FAILED, with why."""


def fleet_decided(precisions: Precisions, worker: PreparedWorker, spec: ModelSpec) -> ModelSpec:
    """``spec`` in the precision the fleet serves its export in (``Precisions``), else in
    the one ``worker`` chose before, else as it is (its load chooses). A host that cannot
    compute the fleet's precision serves fp32, and says so. Raises ``RedisError`` or
    ``OSError``."""
    if spec.dtype != "auto":
        return spec
    model_id = split_served_id(spec.served_id)[0]
    fleet = precisions.read(model_id)
    if fleet is not None and not worker.computes(fleet):
        log.warning(
            "%s is served in %s by the fleet; this host cannot compute it, and serves it in "
            "float32, under an id of its own (set MB_DTYPE fleet-wide on mixed CPUs)",
            model_id,
            fleet,
        )
        fleet = "float32"
    if fleet is not None:
        return spec.decided(fleet, served_model_id(model_id, fleet))
    return worker.decided(spec)


def record_precision(
    precisions: Precisions, worker: PreparedWorker, requested: ModelSpec, loaded: ModelSpec
) -> ModelSpec | None:
    """After a load that chose its precision (``requested`` was ``auto``): record it for the
    fleet; if another worker recorded another one first, that one, to load instead (None:
    keep what loaded). Raises ``RedisError`` or ``OSError``."""
    if requested.dtype != "auto":
        return None
    model_id = split_served_id(loaded.served_id)[0]
    fleet = precisions.record(model_id, loaded.dtype)
    if fleet == loaded.dtype or not worker.computes(fleet):
        return None
    log.info("%s: the fleet serves it in %s: loading it so", model_id, fleet)
    return requested.decided(fleet, served_model_id(model_id, fleet))


class HostLock:
    """At most ``LOADERS_PER_HOST`` loaders per host: as many keys in Redis, each one
    loader's, that expire on their own (a worker that dies holding one frees it within the
    load deadline)."""

    def __init__(self, client: redis.Redis, keys: Keys, host: str, timeout_s: float) -> None:
        self.client = client
        self.slots = [f"{keys.loading(host)}:{slot}" for slot in range(LOADERS_PER_HOST)]
        self.timeout_ms = int(1000 * timeout_s)
        self._release = client.register_script(RELEASE)
        self._held: tuple[str, str] | None = None  # (key, token)

    def take(self) -> bool:
        """True if this worker holds a slot now. Raises ``RedisError`` or ``OSError``."""
        token = uuid.uuid4().hex
        for key in self.slots:
            if self.client.set(key, token, nx=True, px=self.timeout_ms):
                self._held = (key, token)
                return True
        return False

    def release(self) -> None:
        if self._held is None:
            return
        (key, token), self._held = self._held, None
        try:
            self._release(keys=[key], args=[token])
        except (RedisError, OSError) as exc:  # it expires on its own
            log.warning("could not release the host's load slot: %s", exc)


class Loader:
    """A worker's loads: what to load (``aim``), starting the next (``start_next``), and
    taking in the one that ended (``take_in``), for ``WorkerVersions``.

    >>> # loader = Loader(client, keys, worker, repository, host="host-1", timeout_s=300)
    >>> # loader.aim(versions, explicit=True)   # SIGHUP: read the targets, queue the loads
    >>> # loader.start_next(versions, view); loader.take_in(versions, time.monotonic())
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        worker: PreparedWorker,
        repository: Repository,
        *,
        host: str,
        timeout_s: float,
        min_workers: int | None = None,
        on_error: Callable[[str], None] = log.error,
    ) -> None:
        self.worker = worker
        self.repository = repository
        self.timeout_s = timeout_s
        self.min_workers = min_workers
        self._on_error = on_error
        self.pins = PinReader(client, keys)
        self.precisions = Precisions(client, keys)
        self._lock = HostLock(client, keys, host, timeout_s)
        self._queue: list[ModelSpec] = []
        self._loading: Loading | None = None
        self._abandoned: list[Loading] = []  # past their deadline, still running

    @property
    def busy(self) -> bool:
        return self._loading is not None

    def aim(self, versions: Versions, *, explicit: bool) -> None:
        """Read which version each name should serve, and queue the loads of those not
        held. ``explicit`` (``SIGHUP``, the admin route): versions that failed are tried
        again; a poll leaves them failed."""
        try:
            pins = self.pins.read()
        except (RedisError, OSError) as exc:
            self._on_error(f"could not read the admin route's pins: {exc}")
            pins = {}
        targets: dict[str, int | None] = {}
        queue: list[ModelSpec] = []
        for name in self.repository.names():
            try:
                target = targets[name] = self.repository.chosen(name, pins.get(name))
                if target is None:
                    continue
                item = self.repository.read(name, target, self.worker.config.dtype, verify=False)
                spec = self.fleet_decided(item.spec)
            except Exception as exc:  # ModelNotFound, ModelStoreError, Redis: reported
                self._on_error(f"reload: {name}: {getattr(exc, 'message', exc)}")
                targets[name] = UNKNOWN
                continue
            if explicit:
                versions.forget_failures(name)
            if versions.has_failed(name, target):
                continue
            if not versions.holds(spec.served_id):
                queue.append(spec)
            elif versions.number_of(spec.served_id) != target:
                self._adopt(versions, spec)
        versions.aim(targets)
        self._queue = queue

    def fleet_decided(self, spec: ModelSpec) -> ModelSpec:
        """``fleet_decided`` for this worker. Raises ``RedisError`` or ``OSError``."""
        return fleet_decided(self.precisions, self.worker, spec)

    def _adopt(self, versions: Versions, spec: ModelSpec) -> None:
        """The export chosen is one this worker holds, published again under another number
        (a rollback written as the next version): once that folder verifies, the export
        serves under its number, with no load."""
        try:
            read_manifest(Path(spec.store), verify=True)
        except ModelStoreError as exc:
            versions.fail(spec, "verify", str(exc))
            return
        versions.renumber(spec)

    def _record(self, requested: ModelSpec, loaded: ModelSpec) -> ModelSpec | None:
        try:
            return record_precision(self.precisions, self.worker, requested, loaded)
        except (RedisError, OSError) as exc:
            self._on_error(f"could not record the precision of {loaded.served_id}: {exc}")
            return None

    def start_next(self, versions: Versions, view: LiveView | None) -> None:
        """Start the next queued load, if none runs and the host's lock is free."""
        if self._loading is not None or not self._queue:
            return
        spec = self._queue[0]
        late = any(a.spec.served_id == spec.served_id for a in self._abandoned)
        if versions.holds(spec.served_id) or late:
            self._queue.pop(0)  # held already, or a late load of it still running
            return
        gave_up = given_up(view.workers, self.min_workers) if view is not None else {}
        if (spec.name, spec.version) in gave_up:
            # Given up by the others already (this worker started since, say): loading it
            # would only be given up again. The next SIGHUP or admin call tries again.
            self._queue.pop(0)
            return
        try:
            if not self._lock.take():
                return  # another worker of this host is loading: next round
        except (RedisError, OSError) as exc:
            self._on_error(f"could not take the host's load lock: {exc}")
            return
        self._queue.pop(0)
        versions.begin(spec)
        self._loading = Loading(self.worker, spec)

    def take_in(self, versions: Versions, now: float) -> None:
        """The load that ended goes into service (or fails); one past its deadline is
        given up; late ones are dropped."""
        for late in [a for a in self._abandoned if a.done]:
            self._abandoned.remove(late)
            late.drop()
        loading = self._loading
        if loading is None:
            return
        if loading.done:
            self._loading = None
            self._lock.release()
            if loading.failure is not None:
                versions.fail(loading.spec, loading.failure.step, loading.failure.message)
                return
            assert loading.model is not None
            fleet = self._record(loading.spec, loading.model.spec)
            if fleet is not None:  # another worker recorded another precision first
                loading.drop()
                versions.forget(loading.spec)
                self._queue.insert(0, fleet)
                return
            versions.loaded(loading.spec, loading.model, loading.age_s(now))
        elif loading.age_s(now) > self.timeout_s:
            self._loading = None
            self._lock.release()
            self._abandoned.append(loading)
            versions.fail(
                loading.spec,
                "timeout",
                f"not loaded after MB_WORKER_START_TIMEOUT={self.timeout_s:g} s",
            )
