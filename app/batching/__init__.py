"""Micro-batching core: asyncio and the standard library only (no web framework, no torch)."""

from app.batching.streamer import BatchFn, BatchItem, BatchObserver, Streamer, StreamerStats, Trace

__all__ = ["BatchFn", "BatchItem", "BatchObserver", "Streamer", "StreamerStats", "Trace"]
