"""What a broker worker loads, and its loads: each in a thread of its own, so the worker goes
on running batches of the versions it serves while a new one loads, self-tests and warms up;
one worker per host loading at a time, under a lock in Redis, so a host's cores serve while
one of them loads.

When asked (``SIGHUP``, ``MB_REPOSITORY_POLL_S``, or the admin route through Redis:
``app.broker.control``), the ``Loader`` reads which version each name should serve
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
from typing import TYPE_CHECKING

import redis
from redis.exceptions import RedisError

from app.broker.control import PinReader
from app.broker.keys import Keys
from app.broker.live import LiveView
from app.errors import ModelStoreError
from app.lifecycle import LOADERS_PER_HOST, ModelSpec, given_up
from app.manifest import read_manifest
from app.repository import Repository
from app.workers.loading import Loading
from app.workers.process import PreparedWorker

if TYPE_CHECKING:
    from app.broker.versions import WorkerVersions

log = logging.getLogger("app.worker")

UNKNOWN = -1  # a name whose target cannot be read (gone from disk): keep what serves it
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


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
        self._lock = HostLock(client, keys, host, timeout_s)
        self._queue: list[ModelSpec] = []
        self._loading: Loading | None = None
        self._abandoned: list[Loading] = []  # past their deadline, still running

    @property
    def busy(self) -> bool:
        return self._loading is not None

    def aim(self, versions: WorkerVersions, *, explicit: bool) -> None:
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
            except Exception as exc:  # ModelNotFound, ModelStoreError: reported, kept as is
                self._on_error(f"reload: {name}: {getattr(exc, 'message', exc)}")
                targets[name] = UNKNOWN
                continue
            if explicit:
                versions.forget_failures(name)
            if versions.has_failed(name, target):
                continue
            if not versions.holds(item.spec.served_id):
                queue.append(item.spec)
            elif versions.number_of(item.spec.served_id) != target:
                self._adopt(versions, item.spec)
        versions.aim(targets)
        self._queue = queue

    def _adopt(self, versions: WorkerVersions, spec: ModelSpec) -> None:
        """The export chosen is one this worker holds, published again under another number
        (a rollback written as the next version): once that folder verifies, the export
        serves under its number, with no load."""
        try:
            read_manifest(Path(spec.store), verify=True)
        except ModelStoreError as exc:
            versions.fail(spec, "verify", str(exc))
            return
        versions.renumber(spec)

    def start_next(self, versions: WorkerVersions, view: LiveView | None) -> None:
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

    def take_in(self, versions: WorkerVersions, now: float) -> None:
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
            else:
                assert loading.model is not None
                versions.loaded(loading.model, loading.age_s(now))
        elif loading.age_s(now) > self.timeout_s:
            self._loading = None
            self._lock.release()
            self._abandoned.append(loading)
            versions.fail(
                loading.spec,
                "timeout",
                f"not loaded after MB_WORKER_START_TIMEOUT={self.timeout_s:g} s",
            )
