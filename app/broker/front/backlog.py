"""The work waiting for model workers in broker mode, as an autoscaler reads it
(``GET /backlog``; KEDA's metrics-api trigger in the Helm chart)."""

from __future__ import annotations

from collections.abc import Iterable

import redis.asyncio as aioredis

from app.batching import QueueBacklog, StreamCount
from app.broker.wire.keys import GROUP, Keys
from app.broker.wire.parsing import text


async def count_backlog(client: aioredis.Redis, keys: Keys, served: Iterable[str]) -> QueueBacklog:
    """Over the streams of the ``served`` ids, from ``XINFO GROUPS``: entries no worker has
    read (``lag``; Redis cannot tell it after an unread entry was deleted, and then it is the
    entries not pending, as answered entries are deleted), and entries read and not answered
    (``pending``, a dead worker's included). A stream no worker has read yet (scaled to zero)
    counts whole; one that does not exist, not at all. A version's lanes count as its streams
    (``app.broker.wire.lanes``). Raises ``RedisError`` or ``OSError``."""
    versions = sorted(set(served))
    async with client.pipeline(transaction=False) as pipe:
        for served_id in versions:
            pipe.hkeys(keys.lanes(served_id))
        lanes = await pipe.execute()
    streams = [
        stream
        for served_id, names in zip(versions, lanes, strict=True)
        for stream in keys.streams(served_id) + keys.lanes_of(served_id, map(text, names))
    ]
    async with client.pipeline(transaction=False) as pipe:
        for stream in streams:
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)
        answers = await pipe.execute(raise_on_error=False)
    counted = []
    for index, stream in enumerate(streams):
        length, groups = answers[2 * index : 2 * index + 2]
        if isinstance(length, Exception) or isinstance(groups, Exception):
            continue  # no such stream (nothing sent to that version yet)
        group = next((g for g in groups if text(g["name"]) == GROUP), None)
        if group is None:
            counted.append(StreamCount(stream, None, lag=length, pending=0))
            continue
        pending = int(group["pending"])
        lag = group.get("lag")
        lag = max(0, length - pending) if lag is None else int(lag)
        counted.append(StreamCount(stream, GROUP, lag=lag, pending=pending))
    lag, pending = sum(s.lag for s in counted), sum(s.pending for s in counted)
    return QueueBacklog(lag, pending, tuple(counted))
