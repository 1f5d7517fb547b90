"""A model worker's side of broker mode: take batches from the streams of every model version
it holds, run them, reply.

One ``Consumer`` per worker process, in three threads and a loader: the main thread runs
batches (and, between them, decides which versions to load, keep or drain:
``app.broker.worker.versions``; a load runs in a thread of its own meanwhile); a fetcher
reads the next batch (``XREADGROUP``, everything waiting up to the batch size) so that it
arrives as the current one ends, never more than one batch ahead; a heartbeat thread tells
Redis every second that this worker lives, which versions it holds and what it has run.

* **No idle wait**: an idle worker blocks on ``XREADGROUP``, which returns the moment one
  entry exists: a lone request runs at once as a batch of 1, and batches grow with load.
* **Nothing lost**: an entry stays pending in Redis until its reply is pushed; the reply,
  the ``XACK`` and the ``XDEL`` go in one ``MULTI``. Entries pending at a worker whose
  heartbeat stopped (or for longer than ``MB_BATCH_TIMEOUT``) are claimed by another
  (``XCLAIM`` with the idle time seen, so one claimer wins) and run one at a time, so a
  poison input that kills its worker takes no batch-mate with it; past ``MB_MAX_DELIVERIES``
  deliveries it is answered 500 instead of run again.
* **Deadlines on one clock**: an entry's id carries Redis's time when it was added; it is
  dropped unrun once that plus its ``ttl_ms`` has passed by Redis's ``TIME``.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.exceptions import RedisError, ResponseError

from app.broker.wire.connect import drop_idle
from app.broker.wire.keys import GROUP, HEARTBEAT_S, Keys
from app.broker.wire.live import LiveView, LiveWorkers
from app.broker.wire.parsing import text
from app.broker.wire.request import entry_time_ms
from app.broker.worker import spans
from app.broker.worker.entries import Done, Tagged, compute, fields_of, replies, triage
from app.broker.worker.health import Presence, PrimaryWatch, TroubleLog, vital_thread
from app.broker.worker.lanes import is_doorbell
from app.broker.worker.orphans import OrphanClaims
from app.broker.worker.readahead import ReadAhead
from app.broker.worker.replies import RETRY_S, Entry, Replier
from app.broker.worker.sharing import Sharing
from app.broker.worker.stats import ConsumerStats
from app.broker.worker.versions import WorkerVersions
from app.jobs import Task
from app.repository import Repository
from app.workers.handle import rss_bytes
from app.workers.process import PreparedModel, PreparedWorker

log = logging.getLogger("app.worker")

# After a lost read, its entries are taken back if delivered this long before the next read
# began (at least the 50 ms pause after a failure: app.broker.worker.health.TroubleLog).
JUST_BEFORE_S = 0.02
RECLAIM_S = 1.0  # how often a worker looks for entries a dead or hung worker left pending


# One read: each stream's name and the entries read from it.
Fetched = list[tuple[str, list[Entry]]]


class Consumer:
    """One worker process's consumer: ``run(stop)`` until ``stop`` is set, then until what
    only it holds is drained. Its parts: the versions it holds (``WorkerVersions``), the
    entries it takes over from others (``OrphanClaims``), how it answers (``Replier``), its
    heartbeat, and a read-ahead slot its fetcher thread fills.

    >>> # consumer = Consumer(redis.Redis.from_url(url), Keys("mb"), "host-1:0", worker,
    >>> #                     repository=Repository(Path("models")), host="host-1",
    >>> #                     description={...}, max_image_bytes=10 << 20, max_deliveries=3,
    >>> #                     batch_timeout_s=60)
    >>> # consumer.run(threading.Event())
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        name: str,
        worker: PreparedWorker,
        *,
        repository: Repository,
        host: str,
        description: dict[str, Any],
        max_image_bytes: int,
        max_deliveries: int,
        batch_timeout_s: float,
        load_timeout_s: float = 300.0,
        switch_min_workers: int | None = None,
        poll_s: float | None = None,
        on_beat: Callable[[], None] | None = None,
        on_started: Callable[[], None] | None = None,
        load_delay_s: float = 0.0,
        restarted: bool = False,
    ) -> None:
        self.client = client
        self._restarted = restarted  # by its supervisor, after a crash
        self._on_beat = on_beat  # each turn of the heartbeat thread, Redis reachable or not
        self._on_started = on_started  # once its first loads ended
        self.keys = keys
        self.name = name
        self.worker = worker
        self.description = description
        self.max_image_bytes = max_image_bytes
        self.batch_timeout_s = batch_timeout_s
        self.stats = ConsumerStats()
        self._sharing = Sharing()  # identical requests computed once
        self._trouble = TroubleLog(name, self.stats, lambda: drop_idle(client))
        self._primary = PrimaryWatch()
        self._presence = Presence(client, keys, name, self._describe, self._trouble)
        self._live = LiveWorkers(keys)
        # One read ahead at most (at most one batch per task), timed to the compute.
        self._ahead: ReadAhead[Fetched] = ReadAhead()
        self._stop = threading.Event()  # SIGTERM: finish, then stop
        self._stop_fetching = threading.Event()
        self._done = threading.Event()  # heartbeats go on until the last answer is out
        self._running = 0  # items in the batch being run now (for /info)
        self._lost_read = False  # a read failed: its answer, and entries with it, may be lost
        self.draining_since: float | None = None
        self.versions = WorkerVersions(
            client, keys, name, worker, repository, host=host, load_timeout_s=load_timeout_s,
            min_workers=switch_min_workers, poll_s=poll_s, ensure_groups=self._ensure_groups,
            on_error=self._trouble.error, on_load=self.stats.on_load, load_delay_s=load_delay_s,
        )  # fmt: skip
        self._replier = Replier(client, keys, self._stop, self._trouble)
        self.claims = OrphanClaims(
            client, keys, name, self.stats, self._replier, self._process,
            self.versions.held_streams, self._trouble,
            max_image_bytes=max_image_bytes, max_deliveries=max_deliveries,
            batch_timeout_s=batch_timeout_s, stop=self._stop,
        )  # fmt: skip

    def request_reload(self) -> None:
        """``SIGHUP``: load what is new in the repository (safe in a handler)."""
        self.versions.request_reload()

    # -- the main loop -----------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set, and on until what only this worker holds is drained
        (``WorkerVersions.drained``); then finish the batch being run and the one read
        ahead, send the last answers, and take this worker out of the heartbeats."""
        self._stop = self._replier.stop = self.claims.stop = stop
        if not self._presence.join(stop):
            return
        # Once it is the one worker under its name: its first loads.
        self.versions.start(follow=self._restarted)
        beat = vital_thread(self._beat, "heartbeat")
        fetch = vital_thread(self._fetch, "fetcher")
        next_round = time.monotonic() + RECLAIM_S
        while True:
            if time.monotonic() >= next_round:
                if self._round(stop):
                    break
                next_round = time.monotonic() + RECLAIM_S
            fetched = self._ahead.take(timeout_s=0.1 if stop.is_set() else RECLAIM_S)
            if fetched is not None:
                self._run_read(fetched)
            elif stop.is_set():
                next_round = min(next_round, time.monotonic())
        self._stop_fetching.set()
        fetch.join()  # its last read, if any, lands in the slot
        fetched = self._ahead.take(timeout_s=0)
        if fetched is not None:
            self._run_read(fetched)
        self._done.set()
        beat.join(timeout=5)
        self._presence.leave()

    def _round(self, stop: threading.Event) -> bool:
        """Every ``RECLAIM_S``: look at the live workers, turn the versions, claim orphans;
        True once told to stop and drained."""
        view = self._look()
        if self._primary.changed(self.client):
            self._after_failover()
        if stop.is_set():
            if self.draining_since is None:
                self.draining_since = time.monotonic()
                self._presence.send()  # front ends stop routing to it at once
            if view is not None and self.versions.drained(view, self.draining_since):
                return True
        self.claims.recover(own=False)
        self.versions.turn(view, stopping=stop.is_set())
        if self.versions.started.is_set():  # its last life's entries, once it holds models
            self.claims.recover(own=True)
            if self._on_started is not None:
                self._on_started()
        return False

    def _after_failover(self) -> None:
        """Another Redis answers (a replica promoted, or a restart): what the last one
        held and had not passed on is lost. Its answers' acknowledgements may be among it:
        this worker takes back its own pending entries at once (an answer computed again
        reaches nobody twice: a front end takes one reply per request); and the fleet's
        precisions are written again, and the pins read again. Its heartbeat, next second,
        says the rest."""
        log.warning("worker %s: another Redis answers (a failover?); taking back its own "
                    "pending entries", self.name)  # fmt: skip
        self.claims.retake_own()
        self.versions.after_failover()
        try:
            self.versions.precision.restore()
        except (RedisError, OSError) as exc:
            self._trouble.unreachable(exc)

    def _look(self) -> LiveView | None:
        try:
            return self._live.read(self.client)
        except (RedisError, OSError) as exc:
            self._trouble.unreachable(exc)
            return None

    def _run_read(self, fetched: Fetched) -> None:
        """Run what a read gave, the entries of a task's stream and its lanes together,
        higher levels first (a read after a doorbell may hold more than a batch)."""
        tasks: dict[str, list[Tagged]] = {}
        for stream, entries in fetched:
            tasks.setdefault(self.keys.base(stream), []).extend((stream, e) for e in entries)
        for task_stream, tagged in tasks.items():
            if any(stream != task_stream for stream, _ in tagged):  # stable: turns kept
                tagged.sort(key=lambda pair: self.keys.lane_level(pair[0]))
            self._process_tagged(task_stream, tagged)

    # -- reading -----------------------------------------------------------------------------

    def _fetch(self) -> None:
        """The fetcher thread: read the next batch (everything waiting, up to the batch
        size per task) when ``ReadAhead`` says; the read blocks until an entry exists."""
        while self._ahead.wait_turn(self._stop_fetching):
            streams: dict[Any, Any] = {stream: ">" for stream in self.versions.streams}
            if not streams:
                time.sleep(0.1)
                continue
            lanes = self.versions.reading()
            began = time.monotonic()
            try:
                if lanes:  # levels or tenants: a batch in their order (app.broker.worker.lanes)
                    read = self.versions.lanes.read(self.versions.streams, self._batch_sizes())
                else:
                    read = self.client.xreadgroup(
                        GROUP, self.name, streams, count=self.versions.read_batch_size, block=1000
                    )
            except ResponseError as exc:
                if "NOGROUP" in str(exc):  # Redis lost the groups (a restart without data)
                    self._ensure_groups()
                else:
                    self._trouble.error(f"reading failed: {exc}")
                    time.sleep(RETRY_S)
                continue
            except (RedisError, OSError) as exc:
                self._lost_read = True
                self._trouble.unreachable(exc)
                self._trouble.pause()
                continue
            if self._lost_read:
                self._retake_lost(began)
            if read:
                fetched = [(text(stream), fields_of(entries)) for stream, entries in read]
                if any(is_doorbell(fields) for _, entries in fetched for _, fields in entries):
                    fetched += self._read_new_lanes()
                self._ahead.put(fetched, time.monotonic() - began)

    def _read_new_lanes(self) -> Fetched:
        """A doorbell came: learn the new lanes, and take what waits now, the new lanes'
        entries among it (the run orders them by level: ``_run_read``), so a new tenant's
        or level's first request does not wait a batch more."""
        try:
            self.versions.lanes.refresh(list(self.worker.models))
            taken = self.versions.lanes.take(self.versions.streams, self._batch_sizes()) or []
        except (RedisError, OSError) as exc:
            self._lost_read = True
            self._trouble.unreachable(exc)
            self._trouble.pause()
            return []
        return [(text(stream), fields_of(entries)) for stream, entries in taken]

    def _retake_lost(self, began: float) -> None:
        """A read failed on the way (a socket timeout in a Redis stall, a dropped
        connection): Redis may have made entries this worker's that it never saw, which
        would wait out twice ``MB_BATCH_TIMEOUT`` for the orphan claim. Now that a read
        went through, the main loop takes back, at its next round, its own entries still
        pending that were delivered before this read ``began`` (by ``JUST_BEFORE_S``: Redis
        times a delivery to the millisecond): the main loop has run and answered what it
        read before by then, and what this read took is newer."""
        self._lost_read = False
        self.claims.retake_own(delivered_before=began - JUST_BEFORE_S)

    def _batch_sizes(self) -> dict[str, int]:
        """Each version held (served id) and its model's batch size."""
        return {served_id: m.batch_size for served_id, m in list(self.worker.models.items())}

    def _ensure_groups(self, streams: Sequence[str] | None = None) -> None:
        """Create the consumer group on every stream read (or ``streams``), and the streams,
        from their start so nothing already added is skipped; fine if they exist."""
        every = [*self.versions.streams, *self.versions.reading()]
        for stream in every if streams is None else streams:
            while True:
                try:
                    self.client.xgroup_create(stream, GROUP, id="0", mkstream=True)
                except ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
                except (RedisError, OSError) as exc:
                    self._trouble.unreachable(exc)
                    if self._stop.is_set():
                        return
                    self._trouble.pause()
                    continue
                break

    # -- running -----------------------------------------------------------------------------

    def _process(self, stream: str, entries: Sequence[Entry], delivery: int = 1) -> None:
        """Run one stream's (or lane's) entries: ``_process_tagged``."""
        self._process_tagged(self.keys.base(stream), [(stream, e) for e in entries], delivery)

    def _process_tagged(
        self, task_stream: str, entries: Sequence[Tagged], delivery: int = 1
    ) -> None:
        """Run entries of one task's stream and its lanes as batches of its model and answer
        each; drop what must not run. ``delivery``: which time they are handed to a worker
        (over 1: claimed from a worker that died, a retry)."""
        held = self.versions.model_of(task_stream)
        if held is None:  # unloaded meanwhile: left pending, for a worker that holds it
            self._trouble.error(
                f"read {len(entries)} entries of {task_stream}, whose model it no longer holds"
            )
            return
        model, task = held
        # Doorbells (the fetcher has read them) take no place in a batch: acknowledged here.
        bells: dict[str, Done] = {}
        for stream, (entry_id, fields) in entries:
            if is_doorbell(fields):
                bells.setdefault(stream, ([], []))[1].append(entry_id)
        self._replier.answer_all(bells)
        runnable = [(s, entry) for s, entry in entries if not is_doorbell(entry[1])]
        for start in range(0, len(runnable), model.batch_size):
            self._process_batch(model, task, runnable[start : start + model.batch_size], delivery)

    def _process_batch(
        self,
        model: PreparedModel,
        task: Task,
        entries: Sequence[Tagged],
        delivery: int = 1,
    ) -> None:
        # Redis's time now, not when they were read: a read may hold several batches (a
        # task's and another's, or two takes), and the one before may have run past their
        # deadlines.
        now_ms = self._presence.redis_now_ms()
        runnable, streams, done = triage(
            entries, task, now_ms, self.max_image_bytes, self.versions.lanes.lane, self.stats,
            self._trouble.error,
        )  # fmt: skip
        ran = 0
        if runnable:
            started = time.perf_counter()
            self._running = len(runnable)
            served_id = model.spec.served_id
            try:
                requests = [request for _, request in runnable]
                traced = spans.batch(served_id, task, requests, self.name, delivery)
                run = functools.partial(compute, self.worker, self.name, model, task)
                with self._ahead.computing(), traced:
                    spans.queued(runnable, now_ms)
                    answers, size, split = self._sharing.run(served_id, task, requests, run)
                ran = len(split.run)
                answered = replies(runnable, answers, size, split.positions_shared)
                for stream, reply in zip(streams, answered, strict=True):
                    done[stream][0].append(reply)
            finally:
                self._running = 0
            self.stats.shared += split.shared
            waits = [(now_ms - entry_time_ms(entry_id)) / 1000 for entry_id, _ in runnable]
            frontends = len({requests[position].frontend for position in split.run})
            seconds = time.perf_counter() - started
            tenants = [self.keys.lane_tenant(stream) for stream in streams]
            self.stats.record(served_id, task, ran, frontends, seconds, waits, tenants)
        self._replier.answer_all(done)
        if ran:
            self.worker.memory.after_batch()

    # -- heartbeats --------------------------------------------------------------------------

    def _beat(self) -> None:
        """The heartbeat thread: until the last answer is out (not merely until SIGTERM:
        a worker finishing its batch must not look dead, or others would redo it)."""
        if self._on_beat is not None:
            self._on_beat()
        while not self._done.wait(HEARTBEAT_S):
            if self._ahead.busy_for > self.batch_timeout_s:
                # Hung: die, so the supervisor restarts this worker and others claim its
                # entries (as the in-process pool kills a worker past MB_BATCH_TIMEOUT).
                log.error("worker %s spent over MB_BATCH_TIMEOUT on a batch: exiting", self.name)
                os._exit(70)
            if self._on_beat is not None:
                self._on_beat()
            self._presence.send()

    def _describe(self) -> dict[str, Any]:
        """What this worker's heartbeat says of it."""
        advertised = self.versions.advertised
        first = advertised[0] if advertised else {}
        return {
            **self.description,
            "name": self.name,
            "batch_size": self.versions.read_batch_size,
            "models": advertised,
            "model_id": first.get("served_id"),
            "runtime": first.get("runtime"),
            "draining": self.draining_since is not None,
            "aimed": self.versions.aimed,
            "targets": self.versions.aims,
            "ready": any(m["state"] == "ready" for m in advertised),
            "alive": True,
            "running": self._running,
            "rss_bytes": rss_bytes(os.getpid()),
            "cpu_seconds": round(time.process_time(), 3),
            **vars(self.stats),
        }
