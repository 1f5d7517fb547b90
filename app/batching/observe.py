"""What the Streamer tells about its batches: per item (``Trace``) and per batch
(``BatchObserver``)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class Trace:
    """Filled in by the Streamer for one submitted item: what its batch looked like."""

    batch_size: int = 0


# Called once per dispatched batch with its key, its size and each item's queue wait (s).
BatchObserver = Callable[[Hashable, int, Sequence[float]], None]
