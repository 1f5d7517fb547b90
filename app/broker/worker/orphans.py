"""What a broker worker takes over from others: entries pending at workers whose heartbeats
stopped, its own last life's, or its own that Redis refused to let it answer; and the clean-up
that keeps Redis's memory bounded. One ``OrphanClaims`` per consumer, which hands it how to
run and answer an entry and which streams it holds."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import redis
from redis.exceptions import RedisError, ResponseError

from app.broker.wire.keys import GROUP, STALE_S, Keys
from app.broker.wire.live import LiveView, LiveWorkers
from app.broker.wire.parsing import text
from app.broker.wire.reply import encode_error
from app.broker.wire.request import MAX_TTL_MS, decode_request
from app.broker.worker.health import TroubleLog
from app.broker.worker.replies import Entry, Replier
from app.broker.worker.stats import ConsumerStats
from app.errors import InferenceError

log = logging.getLogger("app.worker")

PAGE = 100  # pending entries looked at per round trip
FORGET_S = 600.0  # heartbeats and idle consumers older than this are cleaned up
# Run entries of a stream as the consumer runs what it reads: (stream, entries, which
# delivery this is).
Process = Callable[[str, Sequence[Entry], int], None]


class OrphanClaims:
    """Claims and runs, one at a time, entries their worker can no longer answer.

    >>> # claims = OrphanClaims(client, keys, "host-1:0", stats, replier, consumer.process,
    >>> #                       versions.held_streams, trouble,
    >>> #                       max_image_bytes=..., max_deliveries=3, batch_timeout_s=60,
    >>> #                       stop=stop_event)
    >>> # claims.recover(own=True)     # at start: this worker's last life's
    >>> # claims.recover(own=False)    # every round: dead workers', and its own stuck ones
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        name: str,
        stats: ConsumerStats,
        replier: Replier,
        process: Process,
        held_streams: Callable[[], list[str]],
        trouble: TroubleLog,
        *,
        max_image_bytes: int,
        max_deliveries: int,
        batch_timeout_s: float,
        stop: threading.Event,
    ) -> None:
        self.client = client
        self.keys = keys
        self.name = name
        self.stats = stats
        self.replier = replier
        self.process = process
        self.held_streams = held_streams
        # Asks to take its own entries back (its last life's at start; after a lost read or
        # a failover: from the fetcher's thread or the main one, so numbered by a counter)
        # and the last ask done: an ask made during a recovery is not lost.
        self._asks = itertools.count(1)
        self._own_asked, self._own_done = next(self._asks), 0
        self.trouble = trouble
        self.max_image_bytes = max_image_bytes
        self.max_deliveries = max_deliveries
        self.batch_timeout_s = batch_timeout_s
        self.stop = stop
        self._live = LiveWorkers(keys)
        self._last_cleanup = 0.0
        # Its own entries to take back: those delivered before this life began (its last
        # life's), not the ones its fetcher read since; None: any (after a Redis failover).
        self._own_before: float | None = time.monotonic()

    def retake_own(self, delivered_before: float | None = None) -> None:
        """Take back, at the next ``recover(own=True)``, the entries pending here that were
        delivered before ``delivered_before`` (``time.monotonic()``): after a read whose
        answer was lost, which made entries this worker's in Redis that it never saw (the
        consumer asks once it has run what it read before). ``None``: every one, this
        life's too (another Redis answers: their acknowledgements may be lost). An answer
        computed again reaches nobody twice: a front end takes one reply per request."""
        self._own_before = delivered_before
        self._own_asked = next(self._asks)

    def recover(self, *, own: bool) -> None:
        """Claim and run, one at a time, the entries left pending by this worker's last life
        (``own``: once, when it holds its models again, as it starts with none), by workers
        that stopped sending heartbeats, or stuck here (an answer Redis refused) for twice
        ``MB_BATCH_TIMEOUT``. A live worker's entries are never taken: a hung worker ends
        its own life (``app.broker.worker.consumer``) and stops its heartbeats."""
        asked = self._own_asked
        if own and self._own_done == asked:
            return
        try:
            self._recover_once(own=own)
        except ResponseError as exc:
            self.trouble.error(f"could not look for orphaned entries: {exc}")
            return
        except (RedisError, OSError) as exc:
            self.trouble.unreachable(exc)
            return  # asked again at the next round
        if own:
            self._own_done = asked

    def _recover_once(self, *, own: bool) -> None:
        stop = self.stop
        view = self._live.read(self.client)
        live = view.names
        stuck_ms = int(2000 * self.batch_timeout_s)
        # Entries a dead worker holds have been idle at least since its last heartbeat; its
        # last life's, at least since this life began.
        idle_ms = int(1000 * min(STALE_S, self.batch_timeout_s))
        if own:
            born = self._own_before
            idle_ms = 0 if born is None else int(1000 * (time.monotonic() - born))
        for stream in self.held_streams():
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
                    consumer = text(entry["consumer"])
                    idle = int(entry["time_since_delivered"])
                    if consumer == self.name:
                        orphaned = own or idle >= stuck_ms
                    else:  # dead, or restarted and not (yet) reading it: holding nothing
                        orphaned = consumer not in live or not self._reads(view, consumer, stream)
                    if orphaned:
                        # A delivery (MB_MAX_DELIVERIES) unless it takes its own back after a
                        # lost read or a failover (nothing ran them, let alone failed on
                        # them); its last life's count (it may have died of one).
                        counted = not own or self._own_done == 0
                        delivered = int(entry["times_delivered"])
                        self._take_over(stream, text(entry["message_id"]), idle, delivered, counted)
                if len(pending) < PAGE:
                    break
                start = "(" + text(pending[-1]["message_id"])
        if not own and time.monotonic() - self._last_cleanup > FORGET_S:
            self._last_cleanup = time.monotonic()
            self._forget_the_long_gone(view.now_ms)

    def _reads(self, view: LiveView, consumer: str, stream: str) -> bool:
        """Whether live worker ``consumer`` reads ``stream`` (its heartbeat says it holds the
        stream's version, ready or draining): a worker restarted after dying starts holding
        nothing, and its last life's entries must not wait for its loads."""
        info = view.worker(consumer)
        if info is None:  # its heartbeat does not check: its entries are its own
            return True
        task_stream = self.keys.base(stream)  # a lane's version is its task stream's
        return any(
            task_stream in self.keys.streams(m.served_id)
            for m in info.models
            if info.holds(m.served_id)
        )

    def _take_over(
        self, stream: str, entry_id: str, idle_ms: int, delivered: int, counted: bool = True
    ) -> None:
        """Claim ``entry_id`` and run it, or answer 500 once it was delivered more than
        ``MB_MAX_DELIVERIES`` times; ``counted``: whether this claim is a delivery (taken
        back after a lost read or a failover, it keeps its count: nothing failed on it)."""
        claimed = self.client.xclaim(
            stream, GROUP, self.name, idle_ms, [entry_id],
            retrycount=None if counted else delivered,  # this claim: the delivery that was lost
        )  # fmt: skip
        if not claimed or not claimed[0][1]:
            return  # another worker claimed it first, or it is gone
        self.stats.reclaimed += 1
        fields: dict[bytes, bytes] = claimed[0][1]  # type: ignore[assignment]
        if not counted:
            delivered -= 1
        if delivered + 1 > self.max_deliveries:
            self.stats.given_up += 1
            log.error(
                "worker %s: entry %s was delivered %d times without an answer; answering 500",
                self.name,
                text(entry_id),
                delivered,
            )
            try:
                request = decode_request(fields, self.max_image_bytes)
            except Exception:  # malformed: never run, never answered
                self.replier.answer(stream, [], [entry_id])
                return
            error = InferenceError(f"the model failed on this image {delivered} times")
            reply = encode_error(request.id, 1, error)
            self.replier.answer(stream, [(entry_id, request, reply)], [])
            return
        self.process(stream, [(entry_id, fields)], delivered + 1)

    def _forget_the_long_gone(self, now_ms: int) -> None:
        """Bounded memory: heartbeats not renewed for ``FORGET_S``, and consumers with
        nothing pending idle that long (never one with pending entries: deleting it would
        throw them away)."""
        cutoff = now_ms - int(1000 * FORGET_S)
        gone = self.client.zrangebyscore(self.keys.heartbeats, "-inf", cutoff)
        if gone:
            self.client.zrem(self.keys.heartbeats, *gone)
            self.client.hdel(self.keys.worker_info, *gone)
        for stream in self.held_streams():
            for consumer in self.client.xinfo_consumers(stream, GROUP):
                if consumer["pending"] == 0 and consumer["idle"] > 1000 * FORGET_S:
                    self.client.xgroup_delconsumer(stream, GROUP, consumer["name"])
            # Whatever left every pending list without an answer (a consumer deleted in
            # the moment it was handed an entry, say) is past any deadline by now.
            self.client.xtrim(stream, minid=now_ms - MAX_TTL_MS - int(1000 * FORGET_S))
