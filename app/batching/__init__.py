"""Micro-batching core: asyncio and the standard library only (no web framework, no torch)."""

from app.batching.streamer import BatchFn, BatchItem, Streamer, StreamerStats

__all__ = ["BatchFn", "BatchItem", "Streamer", "StreamerStats"]
