"""A model worker's side of broker mode: take batches from the streams of every model version
it holds, run them, reply.

One ``Consumer`` per worker process, in three threads: the main thread runs batches (and
loads and unloads versions between them: ``app.broker.rotation``); a fetcher reads the next
batch (``XREADGROUP``, everything waiting up to the batch size) so that it arrives as the
current one ends, never more than one batch ahead; a heartbeat thread tells Redis every
second that this worker lives, which versions it holds and what it has run.

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

import logging
import os
import sys
import threading
import time
import traceback
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, cast

import redis
from redis.exceptions import RedisError, ResponseError

from app.broker.health import Heartbeat, NameTaken, TroubleLog
from app.broker.keys import GROUP, HEARTBEAT_S, REPLY_TTL_S, STALE_S, Keys
from app.broker.orphans import Entry, EntryId, OrphanClaims
from app.broker.readahead import ReadAhead
from app.broker.rotation import ModelRotation
from app.broker.stats import ConsumerStats
from app.broker.wire import (
    MalformedMessage,
    Request,
    decode_request,
    encode_error,
    encode_result,
    entry_time_ms,
    text,
)
from app.errors import InferenceError, ServerError
from app.jobs import EmbeddingAndTopK, Task, TopK
from app.repository import Repository
from app.workers.handle import rss_bytes
from app.workers.process import PreparedModel, PreparedWorker
from app.workers.transfer import results

log = logging.getLogger("app.worker")

RECLAIM_S = 1.0  # how often a worker looks for entries a dead or hung worker left pending
# A worker whose name another live process holds waits this long (an earlier life's last
# heartbeat goes stale in STALE_S), then exits with this code.
JOIN_TIMEOUT_S = 2 * STALE_S + 1.0
NAME_TAKEN_EXIT = 3
RETRY_S = 0.5  # after Redis failed us


# One read: each stream's name and the entries read from it.
Fetched = list[tuple[str, list[Entry]]]


class Consumer(ModelRotation, OrphanClaims):
    """One worker process's consumer: ``run(stop)`` until ``stop`` is set, then until what
    only it holds is drained.

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
    ) -> None:
        self.client = client
        self._on_beat = on_beat  # each turn of the heartbeat thread, Redis reachable or not
        self.keys = keys
        self.name = name
        self.worker = worker
        self.repository = repository
        self.host = host
        self.description = description
        self.max_image_bytes = max_image_bytes
        self.max_deliveries = max_deliveries
        self.batch_timeout_s = batch_timeout_s
        self.load_timeout_s = load_timeout_s
        self.switch_min_workers = switch_min_workers
        self.poll_s = poll_s
        self.stats = ConsumerStats()
        self._heartbeat = Heartbeat(client, keys, name, uuid.uuid4().hex)
        self._trouble = TroubleLog(name)
        # One read ahead at most (at most one batch per task), timed to the compute.
        self._ahead: ReadAhead[Fetched] = ReadAhead()
        self._last_cleanup = 0.0
        self._stop = threading.Event()  # SIGTERM: finish, then stop
        self._stop_fetching = threading.Event()
        self._done = threading.Event()  # heartbeats go on until the last answer is out
        self._running = 0  # items in the batch being run now (for /info)
        self._init_rotation()

    # -- the main loop -----------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set, and on until what only this worker holds is drained
        (``_drained``); then finish the batch being run and the one read ahead, send the
        last answers, and take this worker out of the heartbeats."""
        self._stop = stop
        self._ensure_groups()
        if not self._join(stop):
            return
        beat = _thread(self._beat, "heartbeat")
        self._recover(own=True)  # what this worker's last life left pending
        fetch = _thread(self._fetch, "fetcher")
        next_round = time.monotonic() + RECLAIM_S
        while True:
            if time.monotonic() >= next_round:
                if stop.is_set():
                    if self.draining_since is None:
                        self.draining_since = time.monotonic()
                        self._send_heartbeat()  # front ends stop routing to it at once
                    if self._drained():
                        break
                self._recover(own=False)
                self._rotate()
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
        self._leave()

    def _run_read(self, fetched: Fetched) -> None:
        for stream, entries in fetched:
            self._process(stream, entries, self._redis_now_ms())

    def _held(self, stream: str) -> tuple[PreparedModel, Task] | None:
        """The model and task a stream's entries run on; None once unloaded."""
        served = self._streams.get(stream) or self._served_by(stream)
        if served is None or served[0] not in self.worker.models:
            return None
        return self.worker.models[served[0]], served[1]

    def _served_by(self, stream: str) -> tuple[str, Task] | None:
        """A stream retired from the reads but still held (its last entries, or a claim)."""
        for served_id in self.worker.models:
            for task in Task:
                if self.keys.stream(served_id, task) == stream:
                    return served_id, task
        return None

    def _join(self, stop: threading.Event) -> bool:
        """Take this worker's name with a first heartbeat, before reading anything: if a live
        process holds it (an earlier life still exiting, or a second process started under
        the same name), wait up to ``JOIN_TIMEOUT_S`` for its heartbeat to go stale, then
        exit with ``NAME_TAKEN_EXIT`` (its supervisor retries with backoff). Never two
        consumers under one name: the reclaim, the heartbeat and the pending entries are
        each one process's. False if told to stop meanwhile."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not stop.is_set():
            try:
                self._send_heartbeat(raising=True)
                return True
            except NameTaken as exc:
                self._error(str(exc))
                if time.monotonic() > deadline:
                    log.error("worker %s: %s; exiting", self.name, exc)
                    sys.exit(NAME_TAKEN_EXIT)
            time.sleep(HEARTBEAT_S)
        return False

    def _forget_stats(self, served_id: str) -> None:
        """An unloaded version's figures leave the heartbeat (which would otherwise grow with
        every rollout); the front ends' sums for it stop there."""
        self.stats.forget(served_id)

    def _leave(self) -> None:
        """A clean exit: this worker's heartbeat goes now, not after it goes stale."""
        try:
            self._heartbeat.leave()
        except (RedisError, OSError) as exc:
            self._unreachable(exc)

    # -- reading -----------------------------------------------------------------------------

    def _fetch(self) -> None:
        """The fetcher thread: read the next batch (everything waiting, up to the batch
        size per task) when ``ReadAhead`` says; the read blocks until an entry exists."""
        while self._ahead.wait_turn(self._stop_fetching):
            if self._pause_fetching.is_set():  # a load: the main thread runs what was read
                time.sleep(0.05)
                continue
            streams: dict[Any, Any] = {stream: ">" for stream in self._streams}
            if not streams:
                time.sleep(0.1)
                continue
            started = time.perf_counter()
            try:
                read = self.client.xreadgroup(
                    GROUP, self.name, streams, count=self.read_batch_size, block=1000
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
            if read:
                fetched = [(text(stream), entries) for stream, entries in cast(list[Any], read)]
                self._ahead.put(fetched, time.perf_counter() - started)

    def _ensure_groups(self, streams: Sequence[str] | None = None) -> None:
        """Create the consumer group on every stream read (or ``streams``), and the streams,
        from their start so nothing already added is skipped; fine if they exist."""
        for stream in list(self._streams) if streams is None else streams:
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
        """Run one stream's entries as batches of its model and answer each; drop what
        must not run."""
        held = self._held(stream)
        if held is None:  # unloaded meanwhile: left pending, for a worker that holds it
            self._error(f"read {len(entries)} entries of {stream}, whose model it no longer holds")
            return
        model, task = held
        for start in range(0, len(entries), model.batch_size):
            self._process_batch(
                model, stream, task, entries[start : start + model.batch_size], now_ms
            )

    def _process_batch(
        self,
        model: PreparedModel,
        stream: str,
        task: Task,
        entries: Sequence[Entry],
        now_ms: int,
    ) -> None:
        runnable: list[tuple[EntryId, Request]] = []
        dropped: list[EntryId] = []
        for entry_id, fields in entries:
            try:
                request = decode_request(fields, self.max_image_bytes)
                if request.task is not task:
                    raise MalformedMessage(f"a {request.task} request in the {task} stream")
                expired = entry_time_ms(entry_id) + request.ttl_ms <= now_ms
            except Exception as exc:  # MalformedMessage, or anything a forged entry causes
                self._error(f"dropped malformed entry {text(entry_id)[:40]}: {str(exc)[:200]}")
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
            try:
                with self._ahead.computing():
                    replies = self._compute(model, task, runnable)
            finally:
                self._running = 0
            waits = [(now_ms - entry_time_ms(entry_id)) / 1000 for entry_id, _ in runnable]
            frontends = len({request.frontend for _, request in runnable})
            seconds = time.perf_counter() - started
            served_id = model.spec.served_id
            self.stats.record(served_id, task, len(runnable), frontends, seconds, waits)
        self._answer(stream, replies, dropped)
        if runnable:
            self.worker.memory.after_batch()

    def _compute(
        self, model: PreparedModel, task: Task, runnable: Sequence[tuple[EntryId, Request]]
    ) -> list[tuple[EntryId, Request, bytes]]:
        """Decode and run ``runnable`` as one batch: each entry's reply. If the model call
        fails for the batch, each entry is run alone, so only the guilty one gets the 500."""
        size = len(runnable)
        try:
            answers = self._run(model, task, [request for _, request in runnable])
        except Exception:
            if size > 1:
                log.warning("worker %s: a batch of %d failed; running each alone", self.name, size)
                return [reply for one in runnable for reply in self._compute(model, task, [one])]
            log.error("worker %s: a model call failed:\n%s", self.name, traceback.format_exc())
            answers = [InferenceError("model call failed")]
        return [
            (entry_id, request, _encode(request, size, answer))
            for (entry_id, request), answer in zip(runnable, answers, strict=True)
        ]

    def _run(self, model: PreparedModel, task: Task, requests: Sequence[Request]) -> list[object]:
        """Each request's result (an array, ``TopK``, ``EmbeddingAndTopK``) or error, in
        order."""
        decoder = model.decoder
        assert decoder is not None, "a broker worker always decodes"
        pixels, errors = decoder.decode([request.image for request in requests])
        top_ks = [request.top_k for request in requests]
        outputs = {}
        if len(pixels):
            outputs = model.runner.run(task, pixels, max(top_ks))
        positions = range(len(requests))
        answers = results(task, top_ks, positions, outputs, errors)
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
            self._send_heartbeat()

    def _redis_now_ms(self) -> int:
        return self._heartbeat.redis_now_ms()

    def _send_heartbeat(self, *, raising: bool = False) -> None:
        """Tell Redis this worker lives. Another live process holding the name ends this
        one (``raising``: the caller decides), so that two never consume under one name."""
        first = self._advertised[0] if self._advertised else {}
        info = {
            **self.description,
            "name": self.name,
            "batch_size": self.read_batch_size,
            "models": self._advertised,
            "model_id": first.get("served_id"),
            "runtime": first.get("runtime"),
            "draining": self.draining_since is not None,
            "ready": True,
            "alive": True,
            "running": self._running,
            "rss_bytes": rss_bytes(os.getpid()),
            **vars(self.stats),
        }
        try:
            self._heartbeat.send(info)
        except NameTaken as exc:
            if raising:
                raise
            log.error("worker %s: %s; exiting", self.name, exc)
            os._exit(NAME_TAKEN_EXIT)
        except (RedisError, OSError) as exc:  # checked again at the next heartbeat
            self._unreachable(exc)
        else:
            self._trouble.reachable()

    def _unreachable(self, exc: BaseException) -> None:
        self._trouble.unreachable(exc)

    def _error(self, message: str) -> None:
        self._trouble.error(message)


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
    if isinstance(answer, EmbeddingAndTopK):
        top = answer.top_k
        return encode_result(
            request.id,
            batch_size,
            {"embedding": answer.embedding, "indices": top.indices, "probs": top.probs},
        )
    return encode_result(request.id, batch_size, {"embedding": answer})  # type: ignore[dict-item]
