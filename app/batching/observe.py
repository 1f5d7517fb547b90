"""What the Streamer tells about its batches: per item (``Trace``) and per batch
(``BatchObserver``)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Trace:
    """Filled in by the Streamer for a request's items: the size of the (last) batch one ran
    in, and how many it submitted. With a ``link`` (the request's span context,
    ``app.tracing``, opaque here), each item's batch links to it, and ``waits`` gets each
    item's time in the queue: ``[enqueued, dispatched]`` in epoch nanoseconds (dispatched 0
    while it waits)."""

    batch_size: int = 0
    images: int = 0
    link: object | None = None
    waits: list[list[int]] = field(default_factory=list)


# Called once per dispatched batch with its key, its size, and each item's queue wait (s)
# and tenant (its ``Ticket``'s; None without one), in the same order.
BatchObserver = Callable[[Hashable, int, Sequence[float], Sequence[Hashable]], None]
