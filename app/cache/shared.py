"""The shared tier: answers in a Redis every front end reads, so one front end's miss is
every other's hit. It is a cache, never a dependency: a Redis that is down or slow costs a
request at most ``timeout_s``; an exchange with it that fails or times out is counted, and
the tier is then left alone for ``COOL_OFF_S``; no request fails for it.

Its reads and writes go in batches (``_Batches``): the lookups of the requests that arrive
while one ``MGET`` is in flight go together in the next, and the answers of a batch of
images in one pipeline of ``SET``s; one connection each, however many requests are in
flight, so a busy front end pays one round trip for many of them (docs/cache.md)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

import redis.asyncio as aioredis

from app.broker.wire.reply import decode_reply, encode_answer

log = logging.getLogger("app.cache")

TIMEOUT_S = 0.05  # the longest a request waits for the shared cache
COOL_OFF_S = 1.0  # after a failure, the shared cache is not asked for this long
MAX_BATCH = 256  # keys in one MGET, or writes in one pipeline
MAX_PENDING_WRITES = 4096  # writes waiting beyond these are let go (a cache may forget)

Item = TypeVar("Item")


class _Batches(Generic[Item]):
    """Items handed to ``send`` in batches, one batch in flight at a time: what arrives while
    one is sent goes in the next (none waits for a timer, a lone item goes at once)."""

    def __init__(self, send: Callable[[list[Item]], Awaitable[None]], bound: int) -> None:
        self._send = send
        self._bound = bound
        self._waiting: list[Item] = []
        self._sender: asyncio.Task[None] | None = None
        self._closed = False

    def add(self, item: Item) -> bool:
        """Queue ``item`` (False, let go: ``bound`` wait already, or closed)."""
        if self._closed or len(self._waiting) >= self._bound:
            return False
        self._waiting.append(item)
        if self._sender is None:
            self._sender = asyncio.get_running_loop().create_task(self._run())
        return True

    async def _run(self) -> None:
        try:
            while self._waiting:
                batch = self._waiting[:MAX_BATCH]
                del self._waiting[:MAX_BATCH]
                try:
                    await self._send(batch)
                except Exception:  # a bug: the next batch is still sent
                    log.exception("cache: a batch for Redis failed")
        finally:
            self._sender = None

    def drop(self) -> list[Item]:
        """Stop sending, for good; the items that were waiting."""
        self._closed = True
        if self._sender is not None:
            self._sender.cancel()
        waiting, self._waiting = self._waiting, []
        return waiting

    async def stopped(self) -> None:
        if self._sender is not None:
            await asyncio.gather(self._sender, return_exceptions=True)


_Read = tuple[str, "asyncio.Future[object]"]


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
        self._reads: _Batches[_Read] = _Batches(self._mget, bound=1 << 20)
        self._writes: _Batches[tuple[str, bytes]] = _Batches(self._set, MAX_PENDING_WRITES)

    @classmethod
    def connect(
        cls,
        url: str,
        prefix: str,
        ttl_s: float,
        on_error: Callable[[], None],
        timeout_s: float = TIMEOUT_S,
    ) -> SharedCache:
        """A cache in the Redis at ``url`` (Sentinel's too), through a client of its own
        that never retries: its timeouts are the request path's."""
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        from app.broker.wire.connect import connect_async

        client = connect_async(
            url,
            socket_timeout=timeout_s * 5,
            socket_connect_timeout=timeout_s * 5,
            retry=Retry(NoBackoff(), 0),
        )
        return cls(client, prefix, ttl_s, on_error, timeout_s)

    def _name(self, key: bytes) -> str:
        return self._prefix + key.hex()

    @property
    def _quiet(self) -> bool:
        return time.monotonic() < self._quiet_until

    def _failed(self, what: str, exc: BaseException) -> None:
        if self._quiet:  # one failure told per cool-off, however many requests shared it
            return
        self._on_error()
        self._quiet_until = time.monotonic() + COOL_OFF_S
        log.warning("cache: Redis failed a %s (%s); serving without it for %.0f s",
                    what, type(exc).__name__, COOL_OFF_S)  # fmt: skip

    async def get(self, key: bytes) -> object | None:
        """The answer kept under ``key``, or None (none kept, or Redis did not answer)."""
        if self._quiet:
            return None
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        if not self._reads.add((self._name(key), future)):
            return None
        try:
            async with asyncio.timeout(self._timeout_s):
                raw = await future
        except TimeoutError:  # a miss; its MGET, bounded as long, counts a failure if slow
            return None
        if not isinstance(raw, bytes):  # none kept, or the batch failed
            return None
        try:
            answer = decode_reply(raw).result
        except Exception:  # forged or foreign, however it fails to parse: a miss, never a 500
            answer = None
        if answer is None or isinstance(answer, BaseException):  # never written so: ignored
            log.warning("cache: entry %s is not an answer; ignored", key.hex()[:16])
            return None
        return answer

    async def _mget(self, batch: list[_Read]) -> None:
        asked = [(name, future) for name, future in batch if not future.done()]
        if not asked:
            return
        raws: Sequence[object] = [None] * len(asked)
        try:
            async with asyncio.timeout(self._timeout_s):
                raws = await self._client.mget([name for name, _ in asked])
        except Exception as exc:  # down, slow, refused (ACL): every one a miss
            self._failed("read", exc)
        finally:  # answered (cancelled by a close: each a miss), unless it gave up waiting
            for (_, future), raw in zip(asked, raws, strict=True):
                if not future.done():
                    future.set_result(raw)

    def put(self, key: bytes, answer: object) -> None:
        """Keep ``answer`` under ``key``, in the background: a caller never waits for it."""
        if not self._quiet:
            self._writes.add((self._name(key), encode_answer("cache", 1, answer)))

    async def _set(self, batch: list[tuple[str, bytes]]) -> None:
        try:
            async with asyncio.timeout(self._timeout_s * 5):
                async with self._client.pipeline(transaction=False) as pipe:
                    for name, raw in batch:
                        pipe.set(name, raw, px=self._ttl_ms)
                    await pipe.execute()
        except Exception as exc:
            self._failed("write", exc)

    async def aclose(self) -> None:
        for _, future in self._reads.drop():  # each a miss: its request computes, or ends
            if not future.done():
                future.set_result(None)
        self._writes.drop()
        await self._reads.stopped()
        await self._writes.stopped()
        await self._client.aclose()
