"""Micro-batching core: asyncio and the standard library only (no web framework, no torch;
the model vocabulary of ``app.lifecycle``, a leaf, for the seam's types)."""

from app.batching.fair import LevelPolicy, Ticket
from app.batching.observe import BatchObserver, Trace
from app.batching.streamer import Streamer
from app.batching.transport import (
    BatchFn,
    BatchItem,
    ClusterView,
    HeldModel,
    QueueBacklog,
    StreamCount,
    Transport,
    Trial,
    VersionControl,
    WorkerStatus,
)

__all__ = [
    "BatchFn",
    "BatchItem",
    "BatchObserver",
    "ClusterView",
    "HeldModel",
    "LevelPolicy",
    "QueueBacklog",
    "StreamCount",
    "Streamer",
    "Ticket",
    "Trace",
    "Transport",
    "Trial",
    "VersionControl",
    "WorkerStatus",
]
