"""A broker worker's model versions while it serves: what it holds and where each is in its
life (``app.lifecycle.VersionLife``: LOADING -> READY -> DRAINING -> UNLOADED, or FAILED),
what it loads next, which streams it reads, and what its heartbeat says of them.

Each round (``turn``, on the worker's main thread, between batches) it

1. takes in a load that ended (``app.broker.worker.loading``: loads run in a thread of
   their own, so batches go on meanwhile), or gives up one past its deadline;
2. when asked (``SIGHUP``, ``MB_REPOSITORY_POLL_S``, or the admin route through Redis:
   ``app.broker.wire.control``), reads which version each name should serve
   (``app.lifecycle.chosen_version``) and queues the loads of those it lacks;
3. asks the lifecycle's rules what to do with each version it holds, given every live
   worker's heartbeat (``app.lifecycle.fate``: a version that may still serve is never
   retired), and drains the others: their streams leave the reads once empty
   (``SWITCH_GRACE_S`` after it began draining), and it is unloaded ``RETIRE_S`` later if
   they still are; the last worker to hold a version deletes its streams.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.exceptions import RedisError

from app.broker.wire.keys import Keys
from app.broker.wire.live import LiveView
from app.broker.worker.loading import UNKNOWN, Loader
from app.jobs import Task
from app.lifecycle import (
    RETIRE_S,
    SWITCH_GRACE_S,
    Fate,
    ModelSpec,
    Route,
    VersionLife,
    VersionState,
    fate,
    given_up,
    routes,
)
from app.repository import Repository
from app.workers.process import PreparedModel, PreparedWorker

log = logging.getLogger("app.worker")

# Delete a version's streams only while they are empty (a late entry keeps them).
DROP_IF_EMPTY = """
for i = 1, #KEYS do if redis.call('XLEN', KEYS[i]) > 0 then return 0 end end
return redis.call('DEL', unpack(KEYS))
"""


class WorkerVersions:
    """The versions one broker worker holds, loads and drains.

    >>> # versions = WorkerVersions(client, keys, "host-1:0", worker, repository, ...)
    >>> # versions.turn(live_view)          # each round, between batches
    >>> # versions.streams                  # stream -> (served id, task): what to read
    >>> # versions.advertised               # what the heartbeat says of them
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        name: str,
        worker: PreparedWorker,
        repository: Repository,
        *,
        host: str,
        load_timeout_s: float,
        min_workers: int | None = None,
        poll_s: float | None = None,
        ensure_groups: Callable[[Sequence[str]], None],
        on_error: Callable[[str], None] = log.error,
    ) -> None:
        self.client = client
        self.keys = keys
        self.name = name
        self.worker = worker
        self.min_workers = min_workers
        self.poll_s = poll_s
        self._ensure_groups = ensure_groups  # the consumer's: retried while Redis is away
        self._on_error = on_error
        self.loader = Loader(
            client, keys, worker, repository, host=host, timeout_s=load_timeout_s,
            min_workers=min_workers, on_error=on_error,
        )  # fmt: skip
        self._drop_if_empty = client.register_script(DROP_IF_EMPTY)
        self.lives: dict[str, VersionLife] = {}  # served id -> a version held (or loading)
        self.failed: dict[tuple[str, int], VersionLife] = {}  # (name, version) -> FAILED
        self.targets: dict[str, int | None] = {}  # name -> the version it should serve
        self._reading_stopped: dict[str, float] = {}  # served id -> when its reads stopped
        self._unloaded: dict[str, float] = {}  # served id -> when this worker unloaded it
        self._reload = threading.Event()
        self._next_poll = time.monotonic() + (poll_s or 0)
        self.streams: dict[str, tuple[str, Task]] = {}  # what the fetcher reads
        self.advertised: list[dict[str, Any]] = []  # the heartbeat's "models"
        self.read_batch_size = 1
        for served_id, model in worker.models.items():
            life = VersionLife(model.spec.name, model.spec.version, served_id)
            life.move(VersionState.LOADING)
            life.move(VersionState.READY)
            self.lives[served_id] = life
            self._read(served_id)
        self._advertise()

    # -- asked from outside ------------------------------------------------------------------

    def request_reload(self) -> None:
        """``SIGHUP``: read the repository and load what is new (safe in a handler)."""
        self._reload.set()

    def start(self, failures: Sequence[tuple[ModelSpec, str, str]] = ()) -> None:
        """At the worker's start: the targets it started with are read as any reload's,
        and those that failed to load then are failures like any other."""
        for spec, step, reason in failures:
            self.fail(spec, step, reason)
        self.loader.aim(self, explicit=False)
        self._advertise()

    def model_of(self, stream: str) -> tuple[PreparedModel, Task] | None:
        """The model and task a stream's entries run on: one it reads, or one retiring
        whose last entries (or a claim) still come; None once unloaded."""
        served = self.streams.get(stream)
        if served is None:
            for served_id in list(self.lives):
                for task in Task:
                    if self.keys.stream(served_id, task) == stream:
                        served = (served_id, task)
        model = self.worker.models.get(served[0]) if served is not None else None
        return None if model is None or served is None else (model, served[1])

    def held_streams(self) -> list[str]:
        """Every stream of every version held (read, or retiring)."""
        return [s for served_id in list(self.worker.models) for s in self.keys.streams(served_id)]

    # -- each round --------------------------------------------------------------------------

    def turn(self, view: LiveView | None, *, stopping: bool = False) -> None:
        """One round (see the module's docstring); ``view``: the live workers now (None:
        Redis could not say)."""
        now = time.monotonic()
        self.loader.take_in(self, now)
        if not stopping:
            explicit = self._reload.is_set()
            due = self.poll_s is not None and now >= self._next_poll
            try:
                asked = explicit or self.loader.pins.changed()
            except (RedisError, OSError):
                asked = False
            if asked or due:
                self._reload.clear()
                if due:
                    self._next_poll = now + (self.poll_s or 0)
                self.loader.aim(self, explicit=asked)
            self.loader.start_next(self, view)
        if view is not None:
            self._settle(view, now)
        self._advertise()

    # -- what the loader asks and tells ----------------------------------------------------

    def aim(self, targets: dict[str, int | None]) -> None:
        """The version each name should serve now (None: unloaded; ``UNKNOWN``: cannot be
        read); failures of versions no longer chosen are moot (a newer version, a
        rollback)."""
        self.targets = targets
        self.failed = {k: v for k, v in self.failed.items() if targets.get(k[0]) == k[1]}

    def holds(self, served_id: str) -> bool:
        return served_id in self.lives

    def number_of(self, served_id: str) -> int:
        return self.lives[served_id].version

    def has_failed(self, name: str, version: int) -> bool:
        return (name, version) in self.failed

    def forget_failures(self, name: str) -> None:
        """A retry (``SIGHUP``, the admin route): ``name``'s failures are tried again."""
        self.failed = {k: v for k, v in self.failed.items() if k[0] != name}

    def renumber(self, spec: ModelSpec) -> None:
        """The export this worker holds serves under ``spec``'s number from now on (a
        rollback published as the next version, its folder verified)."""
        life = self.lives[spec.served_id]
        log.info("worker %s: %s serves as %s version %d", self.name, life.served_id,
                 spec.name, spec.version)  # fmt: skip
        life.version = spec.version
        model = self.worker.models.get(life.served_id)
        if model is not None:
            model.spec = spec

    def begin(self, spec: ModelSpec) -> None:
        """A load of ``spec`` starts (in the loader's thread)."""
        life = VersionLife(spec.name, spec.version, spec.served_id)
        life.move(VersionState.LOADING)
        self.lives[spec.served_id] = life
        log.info("worker %s: loading %s beside what it serves", self.name, life.label)

    def forget(self, spec: ModelSpec) -> None:
        """A load whose result is dropped (to load it in another precision)."""
        self.lives.pop(spec.served_id, None)

    def loaded(self, requested: ModelSpec, model: PreparedModel, seconds: float) -> None:
        """The load of ``requested`` ended well: the model serves from now on, under its id
        (in the precision chosen: ``requested`` may have left it to the load), its streams
        are read."""
        life = self.lives.pop(requested.served_id)
        life.served_id = model.spec.served_id
        self.lives[life.served_id] = life
        self.worker.hold(model)
        life.move(VersionState.READY)
        self._ensure_groups(self.keys.streams(life.served_id))
        self._read(life.served_id)
        log.info(
            "worker %s: %s loaded in %.1f s; front ends move to it once it is ready on enough "
            "workers",
            self.name,
            life.label,
            seconds,
        )

    def fail(self, spec: ModelSpec, step: str, reason: str) -> None:
        """A load failed (or passed its deadline): the version is FAILED here, with why."""
        life = self.lives.get(spec.served_id)
        if life is not None and life.state is VersionState.LOADING:
            del self.lives[spec.served_id]  # this load's
        else:  # a failure at start, or a folder that claims an export held here
            life = VersionLife(spec.name, spec.version, spec.served_id)
            life.move(VersionState.LOADING)
        life.move(VersionState.FAILED, step, reason)
        self.failed[(spec.name, spec.version)] = life
        log.error(
            "worker %s: loading %s failed: %s: %s; what it served before serves on",
            self.name,
            life.label,
            step,
            reason,
        )

    # -- keeping and draining ----------------------------------------------------------------

    def _settle(self, view: LiveView, now: float) -> None:
        """Keep or drain each version held, by the lifecycle's rules; drain, unload, and
        delete the streams of versions no live worker holds any more."""
        try:
            self._settle_versions(view, now)
            self._drop_unheld_streams(view, now)
        except (RedisError, OSError) as exc:
            self._on_error(f"could not look at the streams: {exc}")

    def _settle_versions(self, view: LiveView, now: float) -> None:
        workers = view.workers
        routed = routes(workers, self.min_workers)
        gave_up = given_up(workers, self.min_workers)
        ready = {(v.name, v.version) for v in self.lives.values() if v.state is VersionState.READY}
        for served_id, life in list(self.lives.items()):
            if life.state is VersionState.LOADING:
                continue
            name = life.name
            target = self.targets.get(name, UNKNOWN)
            route = routed.get(name)
            if target == UNKNOWN:
                target = life.version  # its name's target cannot be read: keep it
            why = gave_up.get((name, life.version))
            decided = fate(
                life,
                route=route,
                target=target,
                target_ready=(name, target) in ready,
                route_held=route is not None and (name, route.version) in ready,
                gave_up=why is not None,
            )
            if decided is Fate.KEEP:
                if life.state is VersionState.DRAINING:
                    life.move(VersionState.READY)
                    self._read(served_id)
                    self._reading_stopped.pop(served_id, None)
                    log.info("worker %s: %s is wanted again", self.name, life.label)
                continue
            if life.state is VersionState.READY:
                reason = _why_drained(life, route, target, why)
                life.move(VersionState.DRAINING, reason=reason)
                log.info("worker %s: %s drains: %s", self.name, life.label, reason)
            self._drain(served_id, life, now)

    def _drain(self, served_id: str, life: VersionLife, now: float) -> None:
        """Stop reading a draining version's streams once they are empty and every front
        end has moved on; unload it ``RETIRE_S`` later if they still are (a late entry puts
        them back in the reads)."""
        stopped = self._reading_stopped.get(served_id)
        if stopped is None:
            if life.age_s(now) >= SWITCH_GRACE_S and self._empty(served_id):
                self.streams = {s: held for s, held in self.streams.items() if held[0] != served_id}
                self._reading_stopped[served_id] = now
        elif now - stopped >= RETIRE_S:
            if self._empty(served_id):
                self._unload(served_id, life)
            else:
                del self._reading_stopped[served_id]
                self._read(served_id)

    def _unload(self, served_id: str, life: VersionLife) -> None:
        self._reading_stopped.pop(served_id, None)
        del self.lives[served_id]
        self.worker.unload(served_id)
        life.move(VersionState.UNLOADED)
        self._unloaded[served_id] = time.monotonic()
        log.info("worker %s: %s drained and unloaded", self.name, life.label)

    def _empty(self, served_id: str) -> bool:
        with self.client.pipeline(transaction=False) as pipe:
            for stream in self.keys.streams(served_id):
                pipe.xlen(stream)
            return not any(pipe.execute())

    def _drop_unheld_streams(self, view: LiveView, now: float) -> None:
        """Once no live worker holds a version this one unloaded, its streams (and their
        group) go, if still empty: every worker that unloaded it tries (``DEL`` twice is
        harmless), for a minute."""
        for served_id, since in list(self._unloaded.items()):
            held = any(m.served_id == served_id for w in view.workers for m in w.models)
            if not held:
                self._drop_if_empty(keys=list(self.keys.streams(served_id)))
            if not held or now - since > 60:
                del self._unloaded[served_id]

    def drained(self, view: LiveView, since: float) -> bool:
        """Told to stop (at ``since``): whether every version this worker holds can be left
        to others. One is, once another live worker that is not stopping holds it; or once
        no such worker holds any version of its name (nothing to hand over to); or once the
        rule serves its name with another version, ``SWITCH_GRACE_S`` has passed and its
        streams are empty."""
        others = [w for w in view.others(self.name) if not w.draining]
        chosen = routes(others, self.min_workers)
        for served_id, life in list(self.lives.items()):
            if life.state is VersionState.LOADING or any(w.holds(served_id) for w in others):
                continue
            live = (VersionState.LOADING, VersionState.READY)
            if not any(m.name == life.name and m.state in live for w in others for m in w.models):
                continue
            route = chosen.get(life.name)
            moved = route is not None and route.served_id != served_id
            settled = time.monotonic() - since >= SWITCH_GRACE_S
            if not (moved and settled and self._empty(served_id)):
                return False
        return True

    # -- what it reads and says --------------------------------------------------------------

    def _read(self, served_id: str) -> None:
        streams = dict(self.streams)
        streams.update({self.keys.stream(served_id, task): (served_id, task) for task in Task})
        self.streams = streams  # one assignment: the fetcher thread reads a whole dict

    def _advertise(self) -> None:
        """What the heartbeat says this worker holds (one assignment: the heartbeat thread
        reads it)."""
        held: list[dict[str, Any]] = []
        for served_id, life in self.lives.items():
            entry: dict[str, Any] = {
                "name": life.name,
                "version": life.version,
                "served_id": served_id,
                "state": life.state.shown,
                "reason": life.reason[:1000],
            }
            model = self.worker.models.get(served_id)
            if model is not None and life.state is not VersionState.LOADING:
                entry.update(model.advertised)
            held.append(entry)
        for life in self.failed.values():
            held.append(
                {"name": life.name, "version": life.version, "served_id": life.served_id,
                 "state": life.state.shown, "step": life.step, "reason": life.reason[:1000]}
            )  # fmt: skip
        self.advertised = held
        sizes = [m.batch_size for m in list(self.worker.models.values())]
        self.read_batch_size = max(sizes, default=1)


def _why_drained(
    life: VersionLife, route: Route | None, target: int | None, why: str | None
) -> str:
    if why is not None:
        return f"given up: {why}"
    if target is None:
        return "unloaded by the admin route"
    if life.version > target:
        return f"withdrawn: version {target} is chosen now"
    if route is not None:
        return f"its name serves version {route.version} now"
    return "no longer chosen"
