"""Micro-batching core: asyncio and the standard library only (no web framework, no torch)."""

from app.batching.streamer import BatchObserver, Streamer, StreamerStats, Trace
from app.batching.transport import BatchFn, BatchItem, Transport

__all__ = [
    "BatchFn",
    "BatchItem",
    "BatchObserver",
    "Streamer",
    "StreamerStats",
    "Trace",
    "Transport",
]
