"""The one view of the live workers, from their heartbeats, that everyone in broker mode
reads: a front end's monitor (readiness, routing, ``/info``), a worker's versions (what
serves, what to retire), its orphan claims (whose entries are a dead worker's), and a
host's probes.

A worker is live while its last heartbeat, stamped on Redis's clock, is younger than
``STALE_S``. One script reads Redis's time, the live names and their descriptions at once,
so the view is of one instant on one clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from app.broker.wire.heartbeat import WorkerInfo, decode_worker_info
from app.broker.wire.keys import STALE_S, Keys
from app.broker.wire.parsing import MalformedMessage, text

# Redis's time (ms), the names whose heartbeat is younger than ARGV[1] ms, and their
# descriptions.
LIVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local names = redis.call('ZRANGEBYSCORE', KEYS[1], now - tonumber(ARGV[1]), '+inf')
local infos = {}
if #names > 0 then infos = redis.call('HMGET', KEYS[2], unpack(names)) end
return {now, names, infos}
"""


@dataclass(frozen=True)
class LiveView:
    """The live workers at Redis's time ``now_ms``: every live name (``names``; a worker
    whose description does not check is live all the same: its entries are its own), the
    descriptions that check (``workers``, by name), and why the others did not."""

    now_ms: int
    names: frozenset[str]
    workers: tuple[WorkerInfo, ...]
    malformed: tuple[str, ...] = ()

    def worker(self, name: str) -> WorkerInfo | None:
        return next((w for w in self.workers if w.name == name), None)

    def others(self, name: str) -> list[WorkerInfo]:
        """Every live worker but ``name``."""
        return [w for w in self.workers if w.name != name]


def _parse(answer: Sequence[Any]) -> LiveView:
    now_ms, names, infos = answer
    workers, malformed = [], []
    for raw in infos:
        try:
            workers.append(decode_worker_info(raw))
        except MalformedMessage as exc:
            malformed.append(str(exc)[:300])
    return LiveView(
        int(now_ms),
        frozenset(text(name) for name in names),
        tuple(sorted(workers, key=lambda w: w.name)),
        tuple(malformed),
    )


class LiveWorkers:
    """Reads the ``LiveView``, from a blocking client (workers, probes) or an asyncio one
    (front ends), in one round trip. Raises ``RedisError`` or ``OSError``.

    >>> # view = LiveWorkers(keys).read(client)          # or: await .aread(async_client)
    >>> # [w.name for w in view.workers], view.now_ms
    """

    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self._keys = [keys.heartbeats, keys.worker_info]
        self._args = [int(1000 * STALE_S)]

    def read(self, client: redis.Redis) -> LiveView:
        answer = client.eval(LIVE, len(self._keys), *self._keys, *self._args)
        return _parse(answer)

    async def aread(self, client: aioredis.Redis | Any) -> LiveView:
        """``client``: an asyncio client (or its pipeline, whose result is then the
        pipeline's to parse with ``parse``)."""
        answer = await client.eval(LIVE, len(self._keys), *self._keys, *self._args)
        return _parse(answer)

    def queue(self, pipe: Any) -> None:
        """Queue the read on a pipeline; ``parse`` its answer."""
        pipe.eval(LIVE, len(self._keys), *self._keys, *self._args)

    @staticmethod
    def parse(answer: Sequence[Any]) -> LiveView:
        return _parse(answer)
