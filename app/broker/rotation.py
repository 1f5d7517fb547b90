"""The part of a broker worker that rotates model versions while it serves: load what is new
in the repository beside what it holds (on ``SIGHUP`` or every ``MB_REPOSITORY_POLL_S``),
unload a version once the routing rule serves its name with another and its streams are
empty, and, told to stop, drain what only it can serve. Mixed into ``Consumer``.

The order across workers (``docs/models.md``): each worker loads the new version beside the
old one (one worker per host at a time, under a lock in Redis, so the host's others serve
meanwhile) and advertises it in its heartbeat; front ends move a name to it once it is ready
on enough live workers (``app.broker.routing``); ``SWITCH_GRACE_S`` later, with the old
version's streams empty, each worker unloads the old version, and the last one to hold it
deletes its streams.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import redis
from redis.exceptions import RedisError

from app.broker.keys import STALE_S, Keys
from app.broker.readahead import ReadAhead
from app.broker.routing import SWITCH_GRACE_S, routes
from app.broker.wire import MalformedMessage, WorkerInfo, decode_worker_info, text
from app.jobs import Task
from app.manifest import read_manifest
from app.repository import ModelSpec, ModelState, Repository
from app.workers.process import LoadFailure, PreparedWorker

log = logging.getLogger("app.worker")

# A version whose streams left the read set is unloaded this long after (a read in flight
# then, which blocks at most a second, has been answered by now), if they are still empty.
RETIRE_S = 2.5
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# Delete a version's streams only while they are empty (a late entry keeps them).
DROP_IF_EMPTY = """
for i = 1, #KEYS do if redis.call('XLEN', KEYS[i]) > 0 then return 0 end end
return redis.call('DEL', unpack(KEYS))
"""
Fetched = list[tuple[str, list[Any]]]


class ModelRotation:
    """Needs, from the consumer it is mixed into, what the annotations below name."""

    client: redis.Redis
    keys: Keys
    name: str
    host: str
    worker: PreparedWorker
    repository: Repository
    switch_min_workers: int | None
    poll_s: float | None
    load_timeout_s: float
    _ahead: ReadAhead[Fetched]
    _stop: threading.Event

    def _init_rotation(self) -> None:
        self._streams: dict[str, tuple[str, Task]] = {}  # stream -> (served id, task) read
        self._advertised: list[dict[str, Any]] = []  # the heartbeat's "models"
        self._loading: ModelSpec | None = None
        self._failed: dict[tuple[str, int], tuple[str, str]] = {}  # -> (served id, reason)
        self._retiring: dict[str, float] = {}  # served id -> when its streams left the reads
        self._unrouted: dict[str, float] = {}  # served id -> since when it serves no name
        self._unloaded: dict[str, float] = {}  # served id -> when this worker unloaded it
        self._withdrawn: set[str] = set()  # held, newer than the version its name chooses
        self._read_batch = 1
        self._reload = threading.Event()
        self._next_poll = time.monotonic() + (self.poll_s or 0)
        self._pause_fetching = threading.Event()
        self.draining_since: float | None = None
        self._release = self.client.register_script(RELEASE)
        self._drop_if_empty = self.client.register_script(DROP_IF_EMPTY)
        for served_id in self.worker.models:
            self._read_streams_of(served_id)
        self._advertise()

    def _run_read(self, fetched: Fetched) -> None:
        raise NotImplementedError

    def _ensure_groups(self, streams: Sequence[str] | None = None) -> None:
        raise NotImplementedError

    def _forget_stats(self, served_id: str) -> None:
        raise NotImplementedError

    def _unreachable(self, exc: BaseException) -> None:
        raise NotImplementedError

    def _error(self, message: str) -> None:
        raise NotImplementedError

    # -- what it holds -----------------------------------------------------------------------

    def _read_streams_of(self, served_id: str) -> None:
        streams = dict(self._streams)
        streams.update({self.keys.stream(served_id, task): (served_id, task) for task in Task})
        self._streams = streams  # one assignment: the fetcher thread reads a whole dict

    def _held_streams(self) -> list[str]:
        """Every stream of every version held (read, or retiring)."""
        return [
            stream for served_id in self.worker.models for stream in self.keys.streams(served_id)
        ]

    def _stop_reading(self, served_id: str) -> None:
        self._streams = {s: held for s, held in self._streams.items() if held[0] != served_id}

    def _advertise(self) -> None:
        """What the heartbeat says this worker holds (one assignment: the heartbeat thread
        reads it)."""
        held: list[dict[str, Any]] = [
            {
                "name": model.spec.name,
                "version": model.spec.version,
                "served_id": served_id,
                "state": ModelState.READY.value,
                "runtime": model.runner.models.runtime,
                "batch_size": model.batch_size,
                "memory_bytes": model.memory_bytes,
            }
            for served_id, model in self.worker.models.items()
        ]
        if self._loading is not None:
            spec = self._loading
            held.append(
                {"name": spec.name, "version": spec.version, "served_id": spec.served_id,
                 "state": ModelState.LOADING.value}
            )  # fmt: skip
        for (name, version), (served_id, reason) in self._failed.items():
            held.append(
                {"name": name, "version": version, "served_id": served_id,
                 "state": ModelState.FAILED.value, "reason": reason[:1000]}
            )  # fmt: skip
        for entry in held:  # no longer chosen: it serves no new name's requests from here
            if entry["served_id"] in self._withdrawn and entry["state"] == ModelState.READY.value:
                entry["state"] = ModelState.DRAINING.value
        self._advertised = held
        self._read_batch = max((m.batch_size for m in self.worker.models.values()), default=1)

    @property
    def read_batch_size(self) -> int:
        """The most entries one read takes (the largest batch of a model held); a snapshot
        taken by ``_advertise``, as the fetcher and heartbeat threads read it."""
        return self._read_batch

    # -- each round --------------------------------------------------------------------------

    def request_reload(self) -> None:
        """``SIGHUP``: look at the repository and load what is new (safe in a handler)."""
        self._reload.set()

    def _rotate(self) -> None:
        """One round: load what is new if asked (or the poll is due), unload what drained."""
        now = time.monotonic()
        if self.poll_s is not None and now >= self._next_poll and self.draining_since is None:
            self._next_poll = now + self.poll_s
            self._reload_new(automatic=True)
        asked = self._reload.is_set() and self.draining_since is None
        if asked and self._reload_new(automatic=False):
            self._reload.clear()
        try:
            workers = self._live_workers()
            self._retire_unrouted(workers, time.monotonic())
            self._drop_unheld_streams(workers, time.monotonic())
        except (RedisError, OSError) as exc:
            self._unreachable(exc)

    def _live_workers(self) -> list[WorkerInfo]:
        seconds, micros = self.client.time()
        now_ms = seconds * 1000 + micros // 1000
        names = self.client.zrangebyscore(
            self.keys.heartbeats, now_ms - int(1000 * STALE_S), "+inf"
        )
        if not names:
            return []
        infos = self.client.hmget(self.keys.worker_info, [text(name) for name in names])
        workers = []
        for raw in infos:
            try:
                workers.append(decode_worker_info(raw))
            except MalformedMessage:
                continue  # the front ends log it
        return workers

    # -- loading -----------------------------------------------------------------------------

    def _reload_new(self, *, automatic: bool) -> bool:
        """Load the chosen version of each model that this worker lacks, then withdraw the
        held versions newer than the chosen one (the repository went back, by the newest's
        removal or a pin): they drain and go as any unrouted version. An older version needs
        no withdrawal: the name leaves it by the rule once the chosen one is ready on every
        worker. False if the host's load lock was busy (try again next round)."""
        done = self._load_chosen(automatic=automatic)
        self._withdraw_newer()
        return done

    def _withdraw_newer(self) -> None:
        chosen: dict[str, int] = {}
        for name in self.repository.names():
            with contextlib.suppress(Exception):  # reported by _load_chosen
                chosen[name] = self.repository.chosen(name)
        held = {(m.spec.name, m.spec.version) for m in self.worker.models.values()}
        withdrawn = {
            served_id
            for served_id, model in self.worker.models.items()
            if (name := model.spec.name) in chosen
            and model.spec.version > chosen[name]
            and (name, chosen[name]) in held
        }
        if withdrawn != self._withdrawn:
            self._withdrawn = withdrawn
            self._advertise()

    def _load_chosen(self, *, automatic: bool) -> bool:
        for name in self.repository.names():
            try:
                number = self.repository.chosen(name)
                store = self.repository.path(name, number)
                manifest = read_manifest(store, verify=False)
            except Exception as exc:
                self._error(f"reload: {name}: {exc}")
                continue
            served_id = manifest.served_id(self.worker.config.dtype)
            spec = ModelSpec(name, number, str(store), served_id, manifest.input.image_shape)
            if served_id in self.worker.models:
                self._renumber(spec)
                continue
            if automatic and (name, number) in self._failed:
                continue
            if not self._load_one(spec):
                return False
        return True

    def _load_one(self, spec: ModelSpec) -> bool:
        token = uuid.uuid4().hex
        lock = self.keys.loading(self.host)
        timeout_ms = int(1000 * self.load_timeout_s)
        try:
            if not self.client.set(lock, token, nx=True, px=timeout_ms):
                return False  # another worker of this host is loading: next round
        except (RedisError, OSError) as exc:
            self._unreachable(exc)
            return False
        try:
            self._loading = spec
            self._advertise()
            self._hand_over_reads()
            started = time.monotonic()
            try:
                self.worker.load(spec)
            except LoadFailure as exc:
                self._failed[(spec.name, spec.version)] = (spec.served_id, exc.message)
                log.error(
                    "worker %s: loading %s failed; what it served before serves on",
                    self.name,
                    exc.describe(),
                )
                return True
            self._failed.pop((spec.name, spec.version), None)
            self._ensure_groups(self.keys.streams(spec.served_id))
            self._read_streams_of(spec.served_id)
            log.info(
                "worker %s: %s version %d (%s) loaded in %.1f s; front ends move to it once "
                "it is ready on enough workers",
                self.name,
                spec.name,
                spec.version,
                spec.served_id,
                time.monotonic() - started,
            )
            return True
        finally:
            self._loading = None
            self._advertise()
            self._pause_fetching.clear()
            try:
                self._release(keys=[lock], args=[token])
            except (RedisError, OSError) as exc:
                self._unreachable(exc)

    def _renumber(self, spec: ModelSpec) -> None:
        """The export chosen is one this worker holds already, under another version number
        (a rollback published as the next version): it serves under the new number, and
        stops retiring if it was."""
        held = self.worker.models[spec.served_id]
        if held.spec.version == spec.version:
            return
        held.spec = spec
        self._unrouted.pop(spec.served_id, None)
        if self._retiring.pop(spec.served_id, None) is not None:
            self._read_streams_of(spec.served_id)
        self._advertise()
        log.info("worker %s: %s serves as %s version %d", self.name, spec.served_id, spec.name,
                 spec.version)  # fmt: skip

    def _hand_over_reads(self) -> None:
        """Before a load: stop reading, and run what was read already (a read in flight
        lands within its one-second block), so nothing waits here while it loads."""
        self._pause_fetching.set()
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            fetched = self._ahead.take(timeout_s=max(0.0, deadline - time.monotonic()))
            if fetched is not None:
                self._run_read(fetched)

    # -- unloading ---------------------------------------------------------------------------

    def _retire_unrouted(self, workers: Sequence[WorkerInfo], now: float) -> None:
        """Unload each version the routing rule no longer serves, while this worker holds
        the one it does: its streams leave the reads once the rule has said so for
        ``SWITCH_GRACE_S`` and they are empty, and it is unloaded ``RETIRE_S`` later if they
        still are."""
        chosen = routes(workers, self.switch_min_workers)
        # Names only: a reference to a model held here would keep its memory past the unload.
        held = [(served_id, model.spec.name) for served_id, model in self.worker.models.items()]
        for served_id, name in held:
            route = chosen.get(name)
            has_it = route is not None and route.served_id in self.worker.models
            if route is None or route.served_id == served_id or not has_it:
                self._unrouted.pop(served_id, None)
                if self._retiring.pop(served_id, None) is not None:
                    self._read_streams_of(served_id)  # routed again: read it again
                continue
            since = self._unrouted.setdefault(served_id, now)
            retiring = self._retiring.get(served_id)
            if retiring is None:
                if now - since >= SWITCH_GRACE_S and self._empty(served_id):
                    self._stop_reading(served_id)
                    self._retiring[served_id] = now
            elif now - retiring >= RETIRE_S:
                if self._empty(served_id):
                    self._unload(served_id, workers)
                else:  # a late entry: read it again, and try later
                    del self._retiring[served_id]
                    self._read_streams_of(served_id)

    def _empty(self, served_id: str) -> bool:
        with self.client.pipeline(transaction=False) as pipe:
            for stream in self.keys.streams(served_id):
                pipe.xlen(stream)
            return not any(pipe.execute())

    def _unload(self, served_id: str, workers: Sequence[WorkerInfo]) -> None:
        self._retiring.pop(served_id, None)
        self._unrouted.pop(served_id, None)
        self.worker.unload(served_id)
        self._unloaded[served_id] = time.monotonic()
        self._withdrawn.discard(served_id)
        self._forget_stats(served_id)
        self._advertise()
        log.info("worker %s: %s drained and unloaded", self.name, served_id)

    def _drop_unheld_streams(self, workers: Sequence[WorkerInfo], now: float) -> None:
        """Once no live worker holds a version this one unloaded, its streams (and their
        group) go, if still empty: every worker that unloaded it tries (``DEL`` twice is
        harmless), for a minute."""
        for served_id, since in list(self._unloaded.items()):
            held = any(m.served_id == served_id for w in workers for m in w.models)
            if not held:
                self._drop_if_empty(keys=list(self.keys.streams(served_id)))
            if not held or now - since > 60:
                del self._unloaded[served_id]

    # -- draining, when told to stop ---------------------------------------------------------

    def _drained(self) -> bool:
        """Told to stop: whether every version this worker holds can be left to others.
        One is, once another live worker that is not stopping holds it; or once no such
        worker holds any version of its name (nothing to hand over to); or once the
        routing rule has served its name with another version for ``SWITCH_GRACE_S`` and
        its streams are empty."""
        now = time.monotonic()
        assert self.draining_since is not None
        try:
            workers = [w for w in self._live_workers() if w.name != self.name]
            others = [w for w in workers if not w.draining]
            chosen = routes(others, self.switch_min_workers)
            for served_id, model in self.worker.models.items():
                name = model.spec.name
                if any(w.holds(served_id) for w in others):
                    continue
                live = (ModelState.LOADING, ModelState.READY)
                if not any(m.name == name and m.state in live for w in others for m in w.models):
                    continue
                route = chosen.get(name)
                moved = route is not None and route.served_id != served_id
                settled = now - self.draining_since >= SWITCH_GRACE_S
                if not (moved and settled and self._empty(served_id)):
                    return False
        except (RedisError, OSError) as exc:
            self._unreachable(exc)
            return False
        return True
