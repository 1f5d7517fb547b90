"""The shared tier: answers in a Redis every front end reads, so one front end's miss is
every other's hit. It is a cache, never a dependency: a Redis that is down or slow costs a
request at most ``timeout_s``, after which the tier is left alone for ``COOL_OFF_S``; each
failure is counted; no request fails for it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from app.broker.wire.parsing import MalformedMessage
from app.broker.wire.reply import decode_reply, encode_answer

log = logging.getLogger("app.cache")

TIMEOUT_S = 0.05  # the longest a request waits for the shared cache
COOL_OFF_S = 1.0  # after a failure, the shared cache is not asked for this long


class SharedCache:
    """Answers under ``<prefix>:cache:<key in hex>``, each kept ``ttl_s`` (Redis's
    ``maxmemory`` with an LRU policy bounds them all: docs/cache.md), in the broker's reply
    format, parsed as defensively (an entry that does not parse is a miss)."""

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str,
        ttl_s: float,
        on_error: Callable[[], None] = lambda: None,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self._client = client
        self._prefix = f"{prefix}:cache:"
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._on_error = on_error
        self._timeout_s = timeout_s
        self._quiet_until = 0.0
        self._writes: set[asyncio.Task[None]] = set()

    @classmethod
    def connect(
        cls, url: str, prefix: str, ttl_s: float, on_error: Callable[[], None]
    ) -> SharedCache:
        """A cache in the Redis at ``url`` (Sentinel's too), through a client of its own
        that never retries: its timeouts are the request path's."""
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        from app.broker.wire.connect import connect_async

        client = connect_async(
            url,
            socket_timeout=TIMEOUT_S * 5,
            socket_connect_timeout=TIMEOUT_S * 5,
            retry=Retry(NoBackoff(), 0),
        )
        return cls(client, prefix, ttl_s, on_error)

    def _name(self, key: bytes) -> str:
        return self._prefix + key.hex()

    def _failed(self, what: str, exc: BaseException) -> None:
        self._on_error()
        self._quiet_until = time.monotonic() + COOL_OFF_S
        log.warning("cache: Redis failed a %s (%s); serving without it for %.0f s",
                    what, type(exc).__name__, COOL_OFF_S)  # fmt: skip

    async def get(self, key: bytes) -> object | None:
        """The answer kept under ``key``, or None (none kept, or Redis did not answer)."""
        if time.monotonic() < self._quiet_until:
            return None
        try:
            async with asyncio.timeout(self._timeout_s):
                raw = await self._client.get(self._name(key))
        except Exception as exc:  # down, slow, refused (ACL): a miss
            self._failed("read", exc)
            return None
        if not isinstance(raw, bytes):  # none kept (a client decoding strings: a bug)
            return None
        try:
            answer = decode_reply(raw).result
        except MalformedMessage:
            answer = None
        if answer is None or isinstance(answer, BaseException):  # never written so: ignored
            log.warning("cache: entry %s is not an answer; ignored", key.hex()[:16])
            return None
        return answer

    def put(self, key: bytes, answer: object) -> None:
        """Keep ``answer`` under ``key``, in the background: a caller never waits for it."""
        if time.monotonic() < self._quiet_until:
            return
        raw = encode_answer("cache", 1, answer)
        task = asyncio.get_running_loop().create_task(self._put(self._name(key), raw))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _put(self, name: str, raw: bytes) -> None:
        try:
            async with asyncio.timeout(self._timeout_s * 5):
                await self._client.set(name, raw, px=self._ttl_ms)
        except Exception as exc:
            self._failed("write", exc)

    async def aclose(self) -> None:
        for task in list(self._writes):
            task.cancel()
        await asyncio.gather(*self._writes, return_exceptions=True)
        await self._client.aclose()
