"""A front end's requests whose callers went (left, timed out, the server stopping): their
entries leave the streams, so a worker that has not read them yet never computes them for
nobody. A delete that fails is let go: a worker drops an entry past its deadline unread."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from app.background import Background
from app.broker.front.waiting import Entry


class Deletes:
    """Deletes of entries nobody waits for, through the client ``client()`` gives (None
    once closed)."""

    def __init__(self, client: Callable[[], aioredis.Redis | None]) -> None:
        self._client = client
        self._background = Background()

    def later(self, stream: str, entry_id: bytes) -> None:
        """Delete one entry, in the background (its caller has gone)."""
        self._background.start(self._delete(stream, entry_id))

    def once_added(self, stream: str, admitting: asyncio.Future[Any]) -> None:
        """Delete the entry an admission adds, once Redis answers it (its caller left while
        the admission script ran)."""
        self._background.start(self._withdraw(stream, admitting))

    async def now(self, entries: Sequence[Entry], timeout_s: float) -> None:
        """Delete ``entries`` in one round trip, waiting at most ``timeout_s`` (the requests
        failed at shutdown, before the clients close)."""
        client = self._client()
        if not entries or client is None:
            return
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(timeout_s):
                async with client.pipeline(transaction=False) as pipe:
                    for entry in entries:
                        pipe.xdel(entry.stream, entry.entry_id)
                    await pipe.execute()

    async def settle(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the deletes under way (before the client closes)."""
        await self._background.settle(timeout_s)

    async def _withdraw(self, stream: str, admitting: asyncio.Future[Any]) -> None:
        with contextlib.suppress(RedisError, OSError):
            added = await admitting
            if isinstance(added, bytes):  # an entry id (not a refusal)
                await self._delete(stream, added)

    async def _delete(self, stream: str, entry_id: bytes) -> None:
        client = self._client()
        if client is None:  # closed meanwhile
            return
        with contextlib.suppress(RedisError, OSError):
            await client.xdel(stream, entry_id)
