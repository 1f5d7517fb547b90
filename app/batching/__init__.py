"""Micro-batching core: asyncio and the standard library only (no web framework, no torch)."""

from app.batching.observe import BatchObserver, Trace
from app.batching.streamer import Streamer
from app.batching.transport import (
    BatchFn,
    BatchItem,
    HeldModel,
    QueueBacklog,
    StreamCount,
    Transport,
    WorkerStatus,
)

__all__ = [
    "BatchFn",
    "BatchItem",
    "BatchObserver",
    "HeldModel",
    "QueueBacklog",
    "StreamCount",
    "Streamer",
    "Trace",
    "Transport",
    "WorkerStatus",
]
