"""A model worker's side of broker mode: take batches from the task streams, run them, reply.

One ``Consumer`` per worker process, in three threads: the main thread runs batches; a
fetcher reads the next batch (``XREADGROUP``, everything waiting up to the batch size) so
that it arrives as the current one ends, never more than one batch ahead; a heartbeat
thread tells Redis every second that this worker lives and what it has run.

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

import json
import logging
import os
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import redis
from redis.exceptions import RedisError, ResponseError

from app.broker.keys import GROUP, Keys
from app.broker.transport import HEARTBEAT_S, REPLY_TTL_S, STALE_S, _text
from app.broker.wire import (
    MAX_TTL_MS,
    MalformedMessage,
    Request,
    decode_request,
    encode_error,
    encode_result,
    entry_time_ms,
)
from app.errors import InferenceError, ServerError
from app.jobs import Task, TopK
from app.metrics import LATENCY_BUCKETS
from app.workers.batches import results
from app.workers.handle import rss_bytes
from app.workers.messages import BatchDone
from app.workers.process import PreparedWorker

log = logging.getLogger("app.worker")

PAGE = 100  # pending entries looked at per round trip
RECLAIM_S = 1.0  # how often a worker looks for entries a dead or hung worker left pending
RETRY_S = 0.5  # after Redis failed us
FORGET_S = 600.0  # heartbeats and idle consumers older than this are cleaned up
# Sets this worker's heartbeat on Redis's clock and its description, in one step.
HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return now
"""
EntryId = bytes | str  # as Redis returns it, or as we pass it back
Entry = tuple[EntryId, dict[bytes, bytes]]


def _histogram() -> list[float]:
    """Counts per ``LATENCY_BUCKETS`` bucket (not cumulative), then +Inf, then the sum."""
    return [0.0] * (len(LATENCY_BUCKETS) + 2)


def _observe(histogram: list[float], value: float) -> None:
    index = next((i for i, le in enumerate(LATENCY_BUCKETS) if value <= le), len(LATENCY_BUCKETS))
    histogram[index] += 1
    histogram[-1] += value


@dataclass
class ConsumerStats:
    """What a worker has run, sent with every heartbeat (front ends turn it into metrics)."""

    batches: int = 0
    items: int = 0
    mixed_batches: int = 0  # batches holding items from more than one front end
    expired: int = 0  # dropped unrun: their deadline had passed
    malformed: int = 0  # dropped unrun: not our format
    reclaimed: int = 0  # taken over from a worker that died or hung
    given_up: int = 0  # answered 500 after MB_MAX_DELIVERIES deliveries
    sizes: dict[str, dict[int, int]] = field(default_factory=dict)  # task -> size -> batches
    model_s: dict[str, list[float]] = field(default_factory=dict)  # task -> histogram
    wait_s: dict[str, list[float]] = field(default_factory=dict)  # task -> histogram

    def record(
        self, task: str, size: int, frontends: int, model_s: float, waits: list[float]
    ) -> None:
        self.batches += 1
        self.items += size
        self.mixed_batches += frontends > 1
        sizes = self.sizes.setdefault(task, {})
        sizes[size] = sizes.get(size, 0) + 1
        _observe(self.model_s.setdefault(task, _histogram()), model_s)
        histogram = self.wait_s.setdefault(task, _histogram())
        for wait in waits:
            _observe(histogram, wait)


# One read: each stream's name and the entries read from it.
Fetched = list[tuple[str, list[Entry]]]


class Consumer:
    """One worker process's consumer: ``run(stop)`` until ``stop`` is set.

    >>> # consumer = Consumer(redis.Redis.from_url(url), Keys("mb"), "host-1:0", prepared,
    >>> #                     description={...}, max_image_bytes=10 << 20, max_deliveries=3,
    >>> #                     batch_timeout_s=60)
    >>> # consumer.run(threading.Event())
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        name: str,
        prepared: PreparedWorker,
        *,
        description: dict[str, Any],
        max_image_bytes: int,
        max_deliveries: int,
        batch_timeout_s: float,
    ) -> None:
        self.client = client
        self.keys = keys
        self.name = name
        self.prepared = prepared
        self.description = description
        self.max_image_bytes = max_image_bytes
        self.max_deliveries = max_deliveries
        self.batch_timeout_s = batch_timeout_s
        self.stats = ConsumerStats()
        self._tasks = {keys.stream(task): task for task in Task}
        self._heartbeat = client.register_script(HEARTBEAT)
        # The fetcher reads only while this slot is empty, and puts its read here: one read
        # ahead at most (at most one batch per task), never a backlog held out of others' reach.
        self._cond = threading.Condition()
        self._slot: Fetched | None = None
        self._busy_since: float | None = None  # while a batch computes (not while it answers)
        self._compute_s = 0.0  # EWMA of a batch's time here, and of a read's
        self._fetch_s = 0.0
        self._last_cleanup = 0.0
        # Redis's clock = this host's monotonic clock + this offset, renewed by every
        # heartbeat (which returns Redis's TIME): deadlines are judged on Redis's clock
        # with no round trip per batch, and never against this host's wall clock.
        self._offset_ms = 0.0
        self._stop = threading.Event()  # SIGTERM: finish, then stop
        self._stop_fetching = threading.Event()
        self._done = threading.Event()  # heartbeats go on until the last answer is out
        self._redis_down = False  # to log an outage once, not every second
        self._logged: dict[str, float] = {}  # error message -> when last logged
        self._running = 0  # items in the batch being run now (for /info)

    # -- the main loop -----------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set; then finish the batch being run and the one read
        ahead, send the last answers, and take this worker out of the heartbeats."""
        self._stop = stop
        self._ensure_groups()
        self._send_heartbeat()
        beat = _thread(self._beat, "heartbeat")
        self._recover(own=True)  # what this worker's last life left pending
        fetch = _thread(self._fetch, "fetcher")
        next_reclaim = time.monotonic() + RECLAIM_S
        while not stop.is_set():
            if time.monotonic() >= next_reclaim:
                self._recover(own=False)
                next_reclaim = time.monotonic() + RECLAIM_S
            fetched = self._take(timeout_s=RECLAIM_S)
            if fetched is not None:
                self._run_read(fetched)
        self._stop_fetching.set()
        fetch.join()  # its last read, if any, lands in the slot
        fetched = self._take(timeout_s=0)
        if fetched is not None:
            self._run_read(fetched)
        self._done.set()
        beat.join(timeout=5)
        self._leave()

    def _take(self, timeout_s: float) -> Fetched | None:
        with self._cond:
            if self._slot is None and timeout_s > 0:
                self._cond.wait(timeout_s)
            fetched, self._slot = self._slot, None
            self._cond.notify_all()  # the fetcher may read again
            return fetched

    def _run_read(self, fetched: Fetched) -> None:
        for stream, entries in fetched:
            self._process(stream, entries, self._redis_now_ms())

    def _set_busy(self, busy: bool) -> None:
        with self._cond:
            self._busy_since = time.monotonic() if busy else None
            self._cond.notify_all()

    def _leave(self) -> None:
        """A clean exit: this worker's heartbeat goes now, not after it goes stale."""
        try:
            self.client.zrem(self.keys.heartbeats, self.name)
            self.client.hdel(self.keys.worker_info, self.name)
        except (RedisError, OSError) as exc:
            self._unreachable(exc)

    # -- reading -----------------------------------------------------------------------------

    def _may_read(self) -> bool:
        """The slot is empty, and the batch computing (if any) is expected to end within
        a read's time: a read now arrives as the model frees up, with what piled up."""
        if self._slot is not None:
            return False
        if self._busy_since is None:
            return True
        return self._busy_since + self._compute_s - self._fetch_s <= time.monotonic()

    def _fetch(self) -> None:
        """The fetcher thread: read the next batch (everything waiting, up to the batch
        size per task) when ``_may_read``; the read blocks until an entry exists."""
        streams: dict[Any, Any] = {stream: ">" for stream in self._tasks}
        while not self._stop_fetching.is_set():
            with self._cond:
                while not self._may_read() and not self._stop_fetching.is_set():
                    lead = 0.5
                    if self._slot is None and self._busy_since is not None:
                        lead = self._busy_since + self._compute_s - self._fetch_s
                        lead = max(0.001, lead - time.monotonic())
                    self._cond.wait(lead)
            if self._stop_fetching.is_set():
                return
            started = time.perf_counter()
            try:
                read = self.client.xreadgroup(
                    GROUP, self.name, streams, count=self.prepared.batch_size, block=1000
                )
            except ResponseError as exc:
                if "NOGROUP" in str(exc):  # Redis lost the groups (a restart without data)
                    self._ensure_groups()
                else:
                    self._error(f"reading failed: {exc}")
                    time.sleep(RETRY_S)
                continue
            except (RedisError, OSError) as exc:
                self._unreachable(exc)
                time.sleep(RETRY_S)
                continue
            if not read:
                continue
            fetch_s = time.perf_counter() - started
            with self._cond:
                if self._busy_since is not None:  # a read that waited says nothing of reads
                    self._fetch_s = _ewma(self._fetch_s, fetch_s)
                self._slot = [(_text(stream), entries) for stream, entries in cast(list[Any], read)]
                self._cond.notify_all()

    def _ensure_groups(self) -> None:
        """Create the consumer group on every stream (and the streams), from their start so
        nothing already added is skipped; fine if they exist."""
        for stream in self._tasks:
            while True:
                try:
                    self.client.xgroup_create(stream, GROUP, id="0", mkstream=True)
                except ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
                except (RedisError, OSError) as exc:
                    self._unreachable(exc)
                    if self._stop.is_set():
                        return
                    time.sleep(RETRY_S)
                    continue
                break

    # -- running -----------------------------------------------------------------------------

    def _process(self, stream: str, entries: Sequence[Entry], now_ms: int) -> None:
        """Run one stream's entries as one batch and answer each; drop what must not run."""
        task = self._tasks[stream]
        runnable: list[tuple[EntryId, Request]] = []
        dropped: list[EntryId] = []
        for entry_id, fields in entries:
            try:
                request = decode_request(fields, self.max_image_bytes)
                if request.task is not task:
                    raise MalformedMessage(f"a {request.task} request in the {task} stream")
                expired = entry_time_ms(entry_id) + request.ttl_ms <= now_ms
            except Exception as exc:  # MalformedMessage, or anything a forged entry causes
                self._error(f"dropped malformed entry {_text(entry_id)[:40]}: {str(exc)[:200]}")
                self.stats.malformed += 1
                dropped.append(entry_id)
                continue
            if expired:
                self.stats.expired += 1  # its caller has had its 504: nobody waits for it
                dropped.append(entry_id)
                continue
            runnable.append((entry_id, request))
        replies: list[tuple[EntryId, Request, bytes]] = []
        if runnable:
            started = time.perf_counter()
            self._running = len(runnable)
            self._set_busy(True)
            try:
                replies = self._compute(task, runnable)
            finally:
                self._set_busy(False)
                self._running = 0
                self._compute_s = _ewma(self._compute_s, time.perf_counter() - started)
            waits = [(now_ms - entry_time_ms(entry_id)) / 1000 for entry_id, _ in runnable]
            frontends = len({request.frontend for _, request in runnable})
            self.stats.record(
                task.value, len(runnable), frontends, time.perf_counter() - started, waits
            )
        self._answer(stream, replies, dropped)

    def _compute(
        self, task: Task, runnable: Sequence[tuple[EntryId, Request]]
    ) -> list[tuple[EntryId, Request, bytes]]:
        """Decode and run ``runnable`` as one batch: each entry's reply. If the model call
        fails for the batch, each entry is run alone, so only the guilty one gets the 500."""
        size = len(runnable)
        try:
            answers = self._run(task, [request for _, request in runnable])
        except Exception:
            if size > 1:
                log.warning("worker %s: a batch of %d failed; running each alone", self.name, size)
                return [reply for one in runnable for reply in self._compute(task, [one])]
            log.error("worker %s: a model call failed:\n%s", self.name, traceback.format_exc())
            answers = [InferenceError("model call failed")]
        return [
            (entry_id, request, _encode(request, size, answer))
            for (entry_id, request), answer in zip(runnable, answers, strict=True)
        ]

    def _run(self, task: Task, requests: Sequence[Request]) -> list[object]:
        """Each request's result (an array, ``TopK``) or error, in order."""
        decoder = self.prepared.decoder
        assert decoder is not None, "a broker worker always decodes"
        pixels, errors = decoder.decode([request.image for request in requests])
        top_ks = [request.top_k for request in requests]
        outputs = {}
        if len(pixels):
            outputs = self.prepared.runner.run(task, pixels, max(top_ks))
        positions = tuple(range(len(requests)))
        answers = results(task, top_ks, positions, BatchDone(0, positions, outputs, 0.0, errors))
        return [answers[position] for position in positions]

    def _answer(
        self, stream: str, replies: Sequence[tuple[EntryId, Request, bytes]], dropped: list[EntryId]
    ) -> None:
        """Push the replies, acknowledge and delete their entries (and the dropped ones),
        in one transaction: an entry leaves the stream exactly when its reply exists."""
        if not replies and not dropped:
            return
        by_frontend: dict[str, list[bytes]] = defaultdict(list)
        for _, request, reply in replies:
            by_frontend[request.frontend].append(reply)
        done = [entry_id for entry_id, _, _ in replies] + dropped
        while True:
            try:
                with self.client.pipeline(transaction=True) as pipe:
                    for frontend, items in by_frontend.items():
                        pipe.rpush(self.keys.replies(frontend), *items)
                        pipe.expire(self.keys.replies(frontend), REPLY_TTL_S)
                    pipe.xack(stream, GROUP, *done)
                    pipe.xdel(stream, *done)
                    pipe.execute()
                return
            except ResponseError as exc:
                if "NOGROUP" in str(exc) or "no such key" in str(exc):
                    return  # the stream or group is gone (Redis came back empty), and its callers
                self._error(f"could not answer {len(done)} entries: {exc}")  # out of memory, say
            except (RedisError, OSError) as exc:
                self._unreachable(exc)
            if self._stop.is_set():  # they stay pending: the next life or another redoes them
                return
            time.sleep(RETRY_S)

    # -- what others left behind -------------------------------------------------------------

    def _recover(self, *, own: bool) -> None:
        """Claim and run, one at a time, the entries left pending by this worker's last life
        (``own``), by workers that stopped sending heartbeats, or stuck here (an answer Redis
        refused) for twice ``MB_BATCH_TIMEOUT``. A live worker's entries are never taken:
        a hung worker ends its own life (see ``_beat``) and stops its heartbeats."""
        try:
            self._recover_once(own=own)
        except ResponseError as exc:
            self._error(f"could not look for orphaned entries: {exc}")
        except (RedisError, OSError) as exc:
            self._unreachable(exc)

    def _recover_once(self, *, own: bool) -> None:
        stop = self._stop
        seconds, micros = self.client.time()
        now_ms = seconds * 1000 + micros // 1000
        live = {
            _text(name)
            for name in self.client.zrangebyscore(
                self.keys.heartbeats, now_ms - int(1000 * STALE_S), "+inf"
            )
        }
        stuck_ms = int(2000 * self.batch_timeout_s)
        # Entries a dead worker holds have been idle at least since its last heartbeat.
        idle_ms = 0 if own else int(1000 * min(STALE_S, self.batch_timeout_s))
        for stream in self._tasks:
            start = "-"
            while not stop.is_set():
                pending = self.client.xpending_range(
                    stream,
                    GROUP,
                    start,
                    "+",
                    PAGE,
                    consumername=self.name if own else None,
                    idle=idle_ms,
                )
                for entry in pending:
                    if stop.is_set():
                        return
                    consumer = _text(entry["consumer"])
                    idle = int(entry["time_since_delivered"])
                    if consumer == self.name:
                        orphaned = own or idle >= stuck_ms
                    else:
                        orphaned = consumer not in live
                    if orphaned:
                        self._take_over(
                            stream, _text(entry["message_id"]), idle, int(entry["times_delivered"])
                        )
                if len(pending) < PAGE:
                    break
                start = "(" + _text(pending[-1]["message_id"])
        if not own and time.monotonic() - self._last_cleanup > FORGET_S:
            self._last_cleanup = time.monotonic()
            self._forget_the_long_gone(now_ms)

    def _take_over(self, stream: str, entry_id: str, idle_ms: int, delivered: int) -> None:
        claimed = self.client.xclaim(stream, GROUP, self.name, idle_ms, [entry_id])
        if not claimed or not claimed[0][1]:
            return  # another worker claimed it first, or it is gone
        self.stats.reclaimed += 1
        fields: dict[bytes, bytes] = claimed[0][1]  # type: ignore[assignment]
        if delivered + 1 > self.max_deliveries:
            self.stats.given_up += 1
            log.error(
                "worker %s: entry %s was delivered %d times without an answer; answering 500",
                self.name,
                _text(entry_id),
                delivered,
            )
            try:
                request = decode_request(fields, self.max_image_bytes)
            except Exception:  # malformed: never run, never answered
                self._answer(stream, [], [entry_id])
                return
            error = InferenceError(f"the model failed on this image {delivered} times")
            self._answer(stream, [(entry_id, request, encode_error(request.id, 1, error))], [])
            return
        self._process(stream, [(entry_id, fields)], self._redis_now_ms())

    def _forget_the_long_gone(self, now_ms: int) -> None:
        """Bounded memory: heartbeats not renewed for ``FORGET_S``, and consumers with
        nothing pending idle that long (never one with pending entries: deleting it would
        throw them away)."""
        cutoff = now_ms - int(1000 * FORGET_S)
        gone = self.client.zrangebyscore(self.keys.heartbeats, "-inf", cutoff)
        if gone:
            self.client.zrem(self.keys.heartbeats, *gone)
            self.client.hdel(self.keys.worker_info, *gone)
        for stream in self._tasks:
            for consumer in self.client.xinfo_consumers(stream, GROUP):
                if consumer["pending"] == 0 and consumer["idle"] > 1000 * FORGET_S:
                    self.client.xgroup_delconsumer(stream, GROUP, consumer["name"])
            # Whatever left every pending list without an answer (a consumer deleted in
            # the moment it was handed an entry, say) is past any deadline by now.
            self.client.xtrim(stream, minid=now_ms - MAX_TTL_MS - int(1000 * FORGET_S))

    # -- heartbeats --------------------------------------------------------------------------

    def _beat(self) -> None:
        """The heartbeat thread: until the last answer is out (not merely until SIGTERM:
        a worker finishing its batch must not look dead, or others would redo it)."""
        while not self._done.wait(HEARTBEAT_S):
            busy_since = self._busy_since
            if busy_since is not None and time.monotonic() - busy_since > self.batch_timeout_s:
                # Hung: die, so the supervisor restarts this worker and others claim its
                # entries (as the in-process pool kills a worker past MB_BATCH_TIMEOUT).
                log.error("worker %s spent over MB_BATCH_TIMEOUT on a batch: exiting", self.name)
                os._exit(70)
            self._send_heartbeat()

    def _redis_now_ms(self) -> int:
        return int(1000 * time.monotonic() + self._offset_ms)

    def _send_heartbeat(self) -> None:
        info = {
            **self.description,
            "name": self.name,
            "batch_size": self.prepared.batch_size,
            "ready": True,
            "alive": True,
            "running": self._running,
            "rss_bytes": rss_bytes(os.getpid()),
            **{key: value for key, value in vars(self.stats).items()},
        }
        try:
            before = time.monotonic()
            now_ms = self._heartbeat(
                keys=[self.keys.heartbeats, self.keys.worker_info],
                args=[self.name, json.dumps(info, separators=(",", ":"))],
            )
            self._offset_ms = float(now_ms) - 500 * (before + time.monotonic())
            if self._redis_down:
                log.info("worker %s: Redis is back", self.name)
            self._redis_down = False
        except (RedisError, OSError) as exc:
            self._unreachable(exc)

    def _unreachable(self, exc: BaseException) -> None:
        if not self._redis_down:
            log.warning("worker %s: Redis unreachable (%s); retrying", self.name, exc)
        self._redis_down = True

    def _error(self, message: str) -> None:
        """Log an error, the same one at most once a minute (no spam from a loop)."""
        now = time.monotonic()
        if now - self._logged.get(message, -60.0) >= 60.0:
            self._logged[message] = now
            if len(self._logged) > 1000:
                self._logged.clear()
            log.error("worker %s: %s", self.name, message)


def _thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread whose unexpected death ends the process: a worker that reads nothing
    while its heartbeats go on would look ready forever. Its supervisor restarts it."""

    def guarded() -> None:
        try:
            target()
        except BaseException:
            log.exception("the %s thread failed; exiting so the worker restarts", name)
            os._exit(71)

    thread = threading.Thread(target=guarded, name=name, daemon=True)
    thread.start()
    return thread


def _encode(request: Request, batch_size: int, answer: object) -> bytes:
    if isinstance(answer, ServerError):
        return encode_error(request.id, batch_size, answer)
    if isinstance(answer, TopK):
        return encode_result(
            request.id, batch_size, {"indices": answer.indices, "probs": answer.probs}
        )
    return encode_result(request.id, batch_size, {"embedding": answer})  # type: ignore[dict-item]


def _ewma(average: float, value: float) -> float:
    return value if average == 0 else 0.8 * average + 0.2 * value
