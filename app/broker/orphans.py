"""The part of a broker worker that takes over what others left: entries pending at workers
whose heartbeats stopped, its own last life's, or its own that Redis refused to let it answer;
and the clean-up that keeps Redis's memory bounded. Mixed into ``Consumer``."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import redis
from redis.exceptions import RedisError, ResponseError

from app.broker.keys import GROUP, STALE_S, Keys
from app.broker.stats import ConsumerStats
from app.broker.wire import MAX_TTL_MS, Request, decode_request, encode_error, text
from app.errors import InferenceError

log = logging.getLogger("app.worker")

PAGE = 100  # pending entries looked at per round trip
FORGET_S = 600.0  # heartbeats and idle consumers older than this are cleaned up
EntryId = bytes | str  # as Redis returns it, or as we pass it back
Entry = tuple[EntryId, dict[bytes, bytes]]


class OrphanClaims:
    """Needs, from the consumer it is mixed into, what the annotations below name."""

    client: redis.Redis
    keys: Keys
    name: str
    stats: ConsumerStats
    max_image_bytes: int
    max_deliveries: int
    batch_timeout_s: float
    _stop: threading.Event
    _last_cleanup: float

    def _process(self, stream: str, entries: Sequence[Entry], now_ms: int) -> None:
        raise NotImplementedError

    def _held_streams(self) -> list[str]:
        raise NotImplementedError

    def _answer(
        self,
        stream: str,
        replies: Sequence[tuple[EntryId, Request, bytes]],
        dropped: list[EntryId],
    ) -> None:
        raise NotImplementedError

    def _redis_now_ms(self) -> int:
        raise NotImplementedError

    def _unreachable(self, exc: BaseException) -> None:
        raise NotImplementedError

    def _error(self, message: str) -> None:
        raise NotImplementedError

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
            text(name)
            for name in self.client.zrangebyscore(
                self.keys.heartbeats, now_ms - int(1000 * STALE_S), "+inf"
            )
        }
        stuck_ms = int(2000 * self.batch_timeout_s)
        # Entries a dead worker holds have been idle at least since its last heartbeat.
        idle_ms = 0 if own else int(1000 * min(STALE_S, self.batch_timeout_s))
        for stream in self._held_streams():
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
                    else:
                        orphaned = consumer not in live
                    if orphaned:
                        self._take_over(
                            stream, text(entry["message_id"]), idle, int(entry["times_delivered"])
                        )
                if len(pending) < PAGE:
                    break
                start = "(" + text(pending[-1]["message_id"])
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
                text(entry_id),
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
        for stream in self._held_streams():
            for consumer in self.client.xinfo_consumers(stream, GROUP):
                if consumer["pending"] == 0 and consumer["idle"] > 1000 * FORGET_S:
                    self.client.xgroup_delconsumer(stream, GROUP, consumer["name"])
            # Whatever left every pending list without an answer (a consumer deleted in
            # the moment it was handed an entry, say) is past any deadline by now.
            self.client.xtrim(stream, minid=now_ms - MAX_TTL_MS - int(1000 * FORGET_S))
