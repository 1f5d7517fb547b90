"""The seam between the Streamer and whatever runs its batches.

The Streamer hands each batch to one async function, ``run_batch(key, items)``; everything
else it and the rest of the server need from the machinery behind it (how many batches may
run at once, how big a batch may be, whether anything can serve, what to show in ``/info``)
is the ``Transport`` protocol below. ``app.workers.pool.WorkerPool`` fills it with model
worker processes on this machine; another transport (a broker shared by many front ends)
fills it without any change to the routers, the services or the Streamer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class BatchItem(Generic[T]):
    """One item as a transport sees it: its id (results are keyed by it), its payload, and
    the moment its caller stops waiting, on the Streamer's clock (``time.monotonic`` unless
    the Streamer was given another), so a transport can forward it or drop the item.
    ``None``: no deadline."""

    id: int
    payload: T
    deadline: float | None = None


# Run a batch of same-key items; return each item's result, or an exception for that item
# alone, keyed by item id. Raising fails the whole batch.
BatchFn = Callable[[Hashable, Sequence[BatchItem[T]]], Awaitable[Mapping[int, Any]]]


class Transport(Protocol[T]):
    """What carries batches from the Streamer to the models and back.

    >>> # transport = WorkerPool(...)          # or any other implementation
    >>> # await transport.start()
    >>> # streamer = Streamer(transport.run_batch, max_batch_size=transport.batch_size,
    >>> #                     max_concurrent_batches=transport.capacity, ...)
    >>> # ... transport.ready, transport.describe() for /readyz and /info ...
    >>> # await transport.aclose()
    """

    async def start(self) -> None:
        """Get ready to run batches; raise ``StartupError`` with a clear message if it cannot."""

    async def aclose(self) -> None:
        """Stop and release everything; idempotent. Batches still running fail."""

    async def run_batch(self, key: Hashable, items: Sequence[BatchItem[T]]) -> Mapping[int, Any]:
        """Run one batch (the Streamer's ``BatchFn``)."""

    @property
    def capacity(self) -> int:
        """How many batches may run at once."""

    @property
    def batch_size(self) -> int:
        """The largest batch to form."""

    @property
    def ready(self) -> bool:
        """Whether a batch sent now can be served (readiness)."""

    @property
    def restart_count(self) -> int:
        """Workers restarted after dying or hanging, since start."""

    @property
    def shared_queue_depth(self) -> int:
        """Requests waiting beyond this process (a broker's shared queue); 0 if none."""

    def describe(self) -> list[dict[str, Any]]:
        """One entry per model worker, in the shape of ``app.schemas.WorkerState``."""
