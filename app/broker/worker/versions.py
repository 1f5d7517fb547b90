"""A broker worker's model versions while it serves: one ``app.lifecycle.Keeper`` (the
lifecycle's steps, written once, the same a pool runs for each of its workers), driven here
with what only a broker worker has: the repository it reads itself, what the admin route
asked through Redis, the streams it reads, and its heartbeat.

Each round (``turn``, on the worker's main thread, between batches) it

1. takes in a load that ended (loads run in a thread of their own, so batches go on
   meanwhile: ``app.workers.loading.LoadSlot``), or gives up one past its deadline;
2. when asked (``SIGHUP``, ``MB_REPOSITORY_POLL_S``, or the admin route through Redis:
   ``app.broker.wire.control``), aims the keeper at each name's target and says in its
   heartbeat which request it acted on (``aimed``);
3. starts the keeper's next load, under the host's lock (one loader per host), in the
   precision the fleet serves its export in (``app.workers.choices.PrecisionChoice``);
4. settles: keeps or drains each version by the lifecycle's rules, given every live
   worker's heartbeat; a drained version's streams leave the reads once empty
   (``SWITCH_GRACE_S`` after it began draining), and it is unloaded ``RETIRE_S`` later if
   they still are; the last worker to hold a version deletes its streams.

A worker starts holding nothing: its first loads are the keeper's like any other (what the
other workers serve first, then each target), and ``started`` is set once they ended.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.exceptions import RedisError

from app.broker.wire.control import PinReader, Precisions
from app.broker.wire.keys import Keys
from app.broker.wire.live import LiveView, LiveWorkers
from app.broker.wire.parsing import text
from app.broker.worker.lanes import LaneReader
from app.broker.worker.loading import HostLock
from app.jobs import Task
from app.lifecycle import (
    RETIRE_S,
    SWITCH_GRACE_S,
    ModelSpec,
    VersionState,
    followed,
    given_up,
    routes,
)
from app.lifecycle.keeper import Effect, Keeper
from app.repository import Repository, scrub
from app.workers.choices import HostChoices, PrecisionChoice
from app.workers.hands import LoadObserver
from app.workers.loading import LoadSlot
from app.workers.process import PreparedModel, PreparedWorker

log = logging.getLogger("app.worker")

# Delete a version's streams and lanes (the first ARGV[1] keys) and its lanes hash only
# while they are empty (a late entry keeps them).
DROP_IF_EMPTY = """
for i = 1, tonumber(ARGV[1]) do if redis.call('XLEN', KEYS[i]) > 0 then return 0 end end
return redis.call('DEL', unpack(KEYS))
"""


class WorkerVersions:
    """The versions one broker worker holds, loads and drains.

    >>> # versions = WorkerVersions(client, keys, "host-1:0", worker, repository, ...)
    >>> # versions.start()                  # aimed as any worker that starts beside others
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
        on_load: LoadObserver = lambda name, version, seconds, failed_step: None,
        load_delay_s: float = 0.0,
    ) -> None:
        self.client = client
        self.keys = keys
        self.name = name
        self.worker = worker
        self.repository = repository
        self.min_workers = min_workers
        self.poll_s = poll_s
        self.load_delay_s = load_delay_s  # testing only: loads after its first ones sleep
        self._ensure_groups = ensure_groups  # the consumer's: retried while Redis is away
        self._on_error = on_error
        self._on_load = on_load  # each load's end, as a pool's host reports it
        self.keeper = Keeper(
            name, min_workers=min_workers, grace_s=SWITCH_GRACE_S,
            retire_s=worker.config.retire_s or RETIRE_S,
            on_error=on_error,
            on_failed=lambda spec, step: on_load(spec.name, spec.version, 0.0, step),
        )  # fmt: skip
        self.pins = PinReader(client, keys)
        self.precision = PrecisionChoice(
            Precisions(client, keys), HostChoices(worker.config.state_dir), worker.computes
        )
        self._lock = HostLock(client, keys, host, load_timeout_s, owner=name)
        self._slot = LoadSlot(load_timeout_s)
        self._drop_if_empty = client.register_script(DROP_IF_EMPTY)
        self.lanes = LaneReader(client, keys, name, ensure_groups)
        self._unloaded: dict[str, float] = {}  # served id -> when this worker unloaded it
        self._reload = threading.Event()
        self._next_poll = time.monotonic() + (poll_s or 0)
        self.started = threading.Event()  # its first loads ended
        self.streams: dict[str, tuple[str, Task]] = {}  # what the fetcher reads
        self.advertised: list[dict[str, Any]] = []  # the heartbeat's "models"
        self.aims: dict[str, int] = {}  # the heartbeat's "targets": each name's, last aimed at
        self.read_batch_size = 1
        self._aimed = False  # aimed once, with the pins read
        self._advertise()

    # -- asked from outside ------------------------------------------------------------------

    def request_reload(self) -> None:
        """``SIGHUP``: read the repository and load what is new (safe in a handler)."""
        self._reload.set()

    @property
    def aimed(self) -> int:
        """The pins' sequence number it last acted on (its heartbeat says)."""
        return self.keeper.aimed

    def start(self, *, follow: bool = False) -> None:
        """At the worker's start: aimed as a worker starting beside the others (what they
        serve first, then each target), and its first load started. ``follow`` (restarted
        after a crash): each target is what the others were aimed at (``followed``), not
        the newest on disk."""
        try:
            others: list[Any] = LiveWorkers(self.keys).read(self.client).others(self.name)
        except (RedisError, OSError) as exc:
            log.warning("worker %s: Redis cannot say what serves now (%s)", self.name, exc)
            others = []
        self._aim(explicit=False, others=others, follow=follow)
        self._start_next(None)
        self._advertise()

    def model_of(self, stream: str) -> tuple[PreparedModel, Task] | None:
        """The model and task a stream's entries run on: one it reads, or one retiring
        whose last entries (or a claim) still come; None once unloaded."""
        served = self.streams.get(stream)
        if served is None:
            for served_id in list(self.worker.models):
                for task in Task:
                    if self.keys.stream(served_id, task) == stream:
                        served = (served_id, task)
        model = self.worker.models.get(served[0]) if served is not None else None
        return None if model is None or served is None else (model, served[1])

    def held_streams(self) -> list[str]:
        """Every stream and lane of every version held (read, or retiring)."""
        held = list(self.worker.models)
        return [s for served_id in held for s in self.keys.streams(served_id)] + self.lanes.of(held)

    def reading(self) -> list[str]:
        """The lanes of the versions read now (their streams: ``streams``)."""
        return self.lanes.of(served_id for served_id, _ in self.streams.values())

    # -- each round --------------------------------------------------------------------------

    def turn(self, view: LiveView | None, *, stopping: bool = False) -> None:
        """One round (see the module's docstring); ``view``: the live workers now (None:
        Redis could not say)."""
        now = time.monotonic()
        self._lock.settle()  # a release Redis could not take
        if self.precision.unrecorded:  # a precision Redis could not take
            with contextlib.suppress(RedisError, OSError):
                self.precision.settle()
        self._take_in(now)
        if not stopping:
            explicit = self._reload.is_set()
            due = self.poll_s is not None and now >= self._next_poll
            try:
                asked = explicit or self.pins.changed()
            except (RedisError, OSError):
                asked = False
            if asked or due:
                self._reload.clear()
                if due:
                    self._next_poll = now + (self.poll_s or 0)
                if not self._aim(explicit=asked) and explicit:
                    self._reload.set()  # the pins could not be read: next round
            self._start_next(view)
        if view is not None:
            try:
                self.lanes.refresh(list(self.worker.models))
            except (RedisError, OSError) as exc:  # the lanes known stay: settle goes on
                self._on_error(f"could not read the lanes: {exc}")
            try:
                self._do(self.keeper.settle(view.workers, now, self._empty))
                self._drop_unheld_streams(view, now)
            except (RedisError, OSError) as exc:
                self._on_error(f"could not look at the streams: {exc}")
        self._advertise()

    def after_failover(self) -> None:
        """Another Redis answers: the pins are read again, whatever their number (another
        front end's write on the new primary may have taken the number this worker saw,
        over other pins)."""
        self._aim(explicit=False)

    def _aim(self, *, explicit: bool, others: Sequence[Any] = (), follow: bool = False) -> bool:
        """Read which version each name should serve (with what the admin route chose) and
        aim the keeper at it; ``others``: the live workers, for one that starts (``follow``:
        aimed at what they were aimed at). Pins that cannot be read keep the last aim (at
        the start, it aims without them): False."""
        try:
            pins = self.pins.read()
        except (RedisError, OSError) as exc:
            self._on_error(f"could not read the admin route's pins: {exc}")
            if self._aimed:  # aimed as before: without the pins, a pin would be undone
                return False
            pins = {}
        self._aimed = True
        targets = self.repository.targets(pins, self._on_error)
        if follow and others:  # restarted beside them: what they were aimed at
            decided = {*pins, *self.repository.pins}
            targets = followed(targets, decided, others, self.repository.versions)
        self.keeper.aim(
            targets, self._read, explicit=explicit, asked=self.pins.seen,
            serving=routes(others, self.min_workers) if others else None,
            gave_up=given_up(others, self.min_workers) if others else (),
        )  # fmt: skip
        return True

    def _read(self, name: str, number: int, verify: bool) -> ModelSpec:
        spec = self.repository.spec(name, number, self.worker.config.dtype, verify=verify)
        return self.precision.decided(spec)

    def _start_next(self, view: LiveView | None) -> None:
        """Start the keeper's next load, if none runs and the host's lock is free."""
        if self._slot.busy:
            return
        spec = self.keeper.next_load(view.workers if view is not None else ())
        if spec is None:
            if self.keeper.loading is None and not self.started.is_set():
                self._started()
            return
        if self._slot.late(spec):
            return  # a load of it given up at its deadline still runs: not twice at once
        try:
            spec = self.precision.decided(spec)  # the fleet may have decided meanwhile
            view = view or LiveWorkers(self.keys).read(self.client)  # one that starts has none
            idle = [w.name for w in view.workers if not w.loading]
            if not self._lock.take(view.names, idle):
                return  # another worker of this host is loading: next round
        except (RedisError, OSError) as exc:
            self._on_error(f"could not take the host's load lock: {exc}")
            return
        self.keeper.begin(spec)
        self._advertise()  # loading, as its next heartbeat says: its slot is not taken over
        delay = self.load_delay_s if self.started.is_set() else 0.0
        self._slot.start(self.worker, spec, delay_s=delay)
        log.info("worker %s: loading %s version %d beside what it serves", self.name,
                 spec.name, spec.version)  # fmt: skip

    def _take_in(self, now: float) -> None:
        """The load that ended goes into service, or fails (one past its deadline too)."""
        ended = self._slot.poll(now)
        if ended is None:
            return
        self._lock.release()
        spec = ended.spec
        if ended.failure is not None:
            reason = scrub(self.repository, ended.failure.message)
            self.keeper.failed_load(spec, ended.failure.step, reason)
            self._on_load(spec.name, spec.version, ended.seconds, ended.failure.step)
            log.error("worker %s: loading %s version %d failed: %s: %s; what it served before "
                      "serves on", self.name, spec.name, spec.version, ended.failure.step,
                      reason)  # fmt: skip
            return
        assert ended.model is not None
        try:
            instead = self.precision.record(spec, ended.model.spec)
        except (RedisError, OSError) as exc:
            self._on_error(f"could not record the precision of {ended.model.spec.served_id}: {exc}")
            instead = None
        if instead is not None:  # another worker recorded another precision first
            ended.model.close()
            self.keeper.dropped(spec, instead)
            return
        self.worker.hold(ended.model)
        self._do(self.keeper.loaded(spec, ended.model.spec))
        self._on_load(spec.name, spec.version, ended.seconds, None)
        log.info(
            "worker %s: %s version %d (%s) loaded in %.1f s; front ends move to it once it is "
            "ready on enough workers",
            self.name, spec.name, spec.version, ended.model.spec.served_id, ended.seconds,
        )  # fmt: skip

    def _started(self) -> None:
        self.started.set()
        held = ", ".join(f"{life.name} {life.version}" for life in self.keeper.held())
        log.info("worker %s started: %s", self.name, held or "nothing loaded")

    # -- what the keeper asks ----------------------------------------------------------------

    def _do(self, effects: Sequence[Effect]) -> None:
        for effect in effects:
            served_id = effect.served_id
            if effect.kind == "read":
                self._ensure_groups(self.keys.streams(served_id))
                streams = dict(self.streams)
                streams.update({self.keys.stream(served_id, t): (served_id, t) for t in Task})
                self.streams = streams  # one assignment: the fetcher thread reads a whole dict
            elif effect.kind == "unread":
                self.streams = {s: h for s, h in self.streams.items() if h[0] != served_id}
            else:
                self.worker.unload(served_id)
                self._unloaded[served_id] = time.monotonic()
                log.info("worker %s: %s drained and unloaded", self.name, served_id)

    def _empty(self, served_id: str) -> bool:
        with self.client.pipeline(transaction=False) as pipe:
            for stream in self.keys.streams(served_id) + tuple(self.lanes.of([served_id])):
                pipe.xlen(stream)
            return not any(pipe.execute())

    def _drop_unheld_streams(self, view: LiveView, now: float) -> None:
        """Once no live worker holds a version this one unloaded, its streams (and their
        group) go, if still empty: every worker that unloaded it tries (``DEL`` twice is
        harmless), for a minute."""
        for served_id, since in list(self._unloaded.items()):
            held = any(m.served_id == served_id for w in view.workers for m in w.models)
            if not held:
                lanes = self.keys.lanes_of(
                    served_id, map(text, self.client.hkeys(self.keys.lanes(served_id)))
                )
                streams = self.keys.streams(served_id) + lanes
                self._drop_if_empty(
                    keys=[*streams, self.keys.lanes(served_id)], args=[len(streams)]
                )
            if not held or now - since > 60:
                del self._unloaded[served_id]

    def drained(self, view: LiveView, since: float) -> bool:
        """Told to stop (at ``since``): whether every version it holds can be left to the
        other live workers (``app.lifecycle.Keeper.drained``)."""
        others = [w for w in view.others(self.name) if not w.draining]
        try:
            return self.keeper.drained(others, since, time.monotonic(), self._empty)
        except (RedisError, OSError) as exc:
            self._on_error(f"could not look at the streams: {exc}")
            return False

    # -- what it says ------------------------------------------------------------------------

    def _advertise(self) -> None:
        """What the heartbeat says this worker holds (one assignment: the heartbeat thread
        reads it)."""
        held: list[dict[str, Any]] = []
        for life in self.keeper.held():
            entry: dict[str, Any] = {
                "name": life.name,
                "version": life.version,
                "served_id": life.served_id,
                "state": life.state.shown,
                "step": life.step,
                "reason": life.reason[:1000],
            }
            model = self.worker.models.get(life.served_id)
            if model is not None and life.state not in (VersionState.LOADING, VersionState.FAILED):
                entry.update(model.advertised)
            held.append(entry)
        self.advertised = held
        self.aims = {name: target for name, target in self.keeper.targets.items()
                     if target is not None and target >= 1}  # fmt: skip
        sizes = [m.batch_size for m in list(self.worker.models.values())]
        self.read_batch_size = max(sizes, default=1)
