"""What the Streamer tells about its batches: per item (``Trace``), per batch
(``BatchObserver``) and in all (``StreamerStats``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Trace:
    """Filled in by the Streamer for one submitted item: what its batch looked like."""

    batch_size: int = 0
    queue_wait_s: float = 0.0


# Called once per dispatched batch with its key, its size and each item's queue wait (s).
BatchObserver = Callable[[Hashable, int, Sequence[float]], None]


@dataclass
class StreamerStats:
    """Counters for observability and tests. ``batch_sizes[key][n]`` counts batches of n."""

    submitted: int = 0
    rejected_queue_full: int = 0
    expired: int = 0
    batches: int = 0
    retried_batches: int = 0
    batch_sizes: dict[Hashable, Counter[int]] = field(default_factory=dict)

    def record_batch(self, key: Hashable, size: int) -> None:
        self.batches += 1
        self.batch_sizes.setdefault(key, Counter())[size] += 1
