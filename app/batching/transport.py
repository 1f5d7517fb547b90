"""The seam between the Streamer and whatever runs its batches.

The Streamer hands each batch to one async function, ``run_batch(key, items)``; everything
else it and the rest of the server need from the machinery behind it (how many batches may
run at once, how big a batch may be, whether anything can serve, the state of each model
worker for ``/readyz``, ``/info`` and the metrics) is the ``Transport`` protocol below.
``app.workers.pool.WorkerPool`` fills it with model worker processes on this machine,
``app.broker.front.transport.BrokerTransport`` with the workers behind a Redis broker, and
``app.testing.FakeTransport`` with a function, for tests; ``Engine`` and ``create_app`` take
any of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from app.batching.fair import Ticket
from app.lifecycle import AdminPin, Route, VersionState, WorkerView

if TYPE_CHECKING:
    from app.repository import Repository

T = TypeVar("T")
NO_TICKET = Ticket()  # the server's own work (the batch job): the highest level, no tenant


@dataclass(frozen=True, slots=True)
class Trial:
    """One runtime and precision a worker tried for a model at load (``MB_RUNTIME``,
    ``MB_DTYPE=auto``): its agreement with fp32 TorchScript on the self-test images (the
    least embedding cosine, the share of equal top-1 classes; None for the reference
    itself or without a classifier), whether it passed its gate, and images/s where timed."""

    label: str  # "openvino", "openvino+bf16", "torchscript+bf16"...
    passed: bool
    cosine_min: float | None = None
    top1: float | None = None
    images_per_s: float | None = None


@dataclass(frozen=True, slots=True)
class HeldModel:
    """One model version a worker holds, is loading or failed to load: its name, number and
    served id, its state (an ``app.lifecycle.VersionState`` as ``shown``), and once loaded
    what runs it, the runtimes that failed their self-test or load there (with why), how
    many times slower than the runtime its export asked for it runs (None: not slower, or
    not known), the largest batch it wants and what it costs the worker."""

    served_id: str
    state: str
    runtime: str | None = None
    batch_size: int | None = None
    memory_bytes: int | None = None
    reason: str = ""  # why it failed to load
    name: str = ""
    version: int = 0
    skipped: tuple[tuple[str, str], ...] = ()  # (runtime, why it was not used)
    slowdown: float | None = None
    dtype: str | None = None  # the precision that computes it, once loaded
    trials: tuple[Trial, ...] = ()  # what the choice of runtime and precision saw


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One model worker as a transport reports it (``/readyz``, ``/info``, the metrics)."""

    index: int
    device: str
    threads: int
    pid: int | None
    ready: bool  # loaded and serving
    alive: bool
    batch_size: int  # the largest batch it takes (with MB_BATCH_SIZE=auto, its choice)
    batches: int  # model calls it has run
    items: int  # images it has been given
    rss_bytes: int | None = None  # its resident memory
    cpu_seconds: float | None = None  # the CPU time it has used (user + system)
    restarts: int = 0  # times this worker slot was restarted after dying or hanging
    runtime: str | None = None  # what runs its model (MB_RUNTIME), once it is ready
    name: str | None = None  # broker mode: "<host>:<index>"
    host: str | None = None  # broker mode: the worker's host
    models: tuple[HeldModel, ...] = ()  # the models it holds or is loading


@dataclass(frozen=True, slots=True)
class StreamCount:
    """One shared queue's work (broker mode: a model version's stream for one task)."""

    stream: str
    group: str | None  # the workers' consumer group; None until one reads
    lag: int  # entries no worker has read yet
    pending: int  # entries read and not answered yet


@dataclass(frozen=True, slots=True)
class QueueBacklog:
    """The work waiting for model workers (``GET /backlog``, what an autoscaler reads)."""

    lag: int
    pending: int
    streams: tuple[StreamCount, ...] = ()

    @property
    def backlog(self) -> int:
        return self.lag + self.pending


@dataclass(frozen=True, slots=True)
class BatchItem(Generic[T]):
    """One item as a transport sees it: its id (results are keyed by it), its payload, and
    the moment its caller stops waiting, on the Streamer's clock (``time.monotonic`` unless
    the Streamer was given another), so a transport can forward it or drop the item.
    ``None``: no deadline. ``link``: its request's trace context (``app.tracing``), when
    traced, for the worker's batch span. ``ticket``: its priority level and tenant, for a
    transport that queues again (broker mode's lanes)."""

    id: int
    payload: T
    deadline: float | None = None
    link: object | None = None
    ticket: Ticket = NO_TICKET


@dataclass(frozen=True)
class ClusterView:
    """What the workers hold and serve, as last seen: each worker's versions (its heartbeat,
    or its pool's record of it), the version each name serves by ``app.lifecycle.routes``,
    and what the admin route set; scaling from zero (broker mode), the served ids whose
    requests queue for workers to come (``queued``).

    >>> from types import SimpleNamespace as Seen
    >>> ready = Seen(served_id="tiny@2", state=VersionState.READY)
    >>> worker = Seen(alive=True, draining=False, models=(ready,))
    >>> view = ClusterView((worker,), queued=frozenset({"tiny@1"}))  # type: ignore[arg-type]
    >>> view.answers("tiny@2"), view.answers("tiny@1"), view.answers("tiny@3")
    (True, True, False)
    """

    workers: Sequence[WorkerView] = ()
    routes: Mapping[str, Route] = dataclasses.field(default_factory=dict)
    pins: Mapping[str, AdminPin] = dataclasses.field(default_factory=dict)
    queued: Set[str] = frozenset()

    def answers(self, served_id: str) -> bool:
        """Whether a request for ``served_id`` sent now is answered: a live worker that is
        not draining holds it ready (a worker that died takes its hold with it), or its
        requests queue for workers to come."""
        return served_id in self.queued or any(
            m.served_id == served_id and m.state is VersionState.READY
            for w in self.workers
            if w.alive and not w.draining
            for m in w.models
        )


class VersionControl(Protocol):
    """How a process that admits requests has model versions loaded, and learns which
    serve: its pool's workers (in-process: the pool aims, loads and drains each through an
    ``app.lifecycle.Keeper``), or the workers behind a broker (each does so itself, told
    through Redis). Both give the same view, and ``app.services.models.Models`` follows it
    and asks through it, in either mode.

    >>> # control.attach(repository, "auto", on_view=models.follow, in_use=registry.in_use)
    >>> # asked = await control.pin("tagger", 3)      # every worker aims at version 3
    >>> # control.view.routes["tagger"]                # once ready where it must be
    """

    def attach(
        self,
        repository: Repository,
        dtype: str,
        on_view: Callable[[ClusterView], None],
        in_use: Callable[[str], bool],
    ) -> None:
        """Before ``start``: the repository its workers load from (MB_DTYPE ``dtype``), who
        hears each new view, and whether this process still has requests for an export (a
        served id) that its workers must not unload yet."""

    async def pin(self, name: str, pin: AdminPin | None) -> int:
        """Set (None: clear) what the admin route chose for ``name``, and have every worker
        act on it now, retrying what failed; returns the number of this request, which
        each worker's view says it acted on (``WorkerView.aimed``). Raises
        ``BrokerUnavailable``."""

    async def reload(self, *, explicit: bool) -> int:
        """Have every worker read the repository again (``kill -HUP``, the poll: not
        ``explicit``, which never retries what failed); its number, as ``pin``'s."""

    @property
    def view(self) -> ClusterView:
        """The workers, routes and pins as of the last look."""

    async def refresh(self) -> None:
        """Look again now (throttled, shared with concurrent callers), or wait a moment for
        a change where the view is always current."""


# Run a batch of same-key items; return each item's result, or an exception for that item
# alone, keyed by item id. Raising fails the whole batch.
BatchFn = Callable[[Hashable, Sequence[BatchItem[T]]], Awaitable[Mapping[int, Any]]]


class Transport(Protocol[T]):
    """What carries batches from the Streamer to the models and back.

    >>> # transport = WorkerPool(...)          # or any other implementation
    >>> # await transport.start()
    >>> # streamer = Streamer(transport.run_batch, max_batch_size=transport.batch_size,
    >>> #                     max_concurrent_batches=transport.capacity, ...)
    >>> # ... transport.ready, transport.worker_status() for /readyz and /info ...
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
        """The largest batch to form, of any key."""

    def batch_size_for(self, key: Hashable) -> int:
        """The largest batch to form of ``key``'s items (its model's own)."""

    @property
    def ready(self) -> bool:
        """Whether a batch sent now can be served (readiness)."""

    @property
    def shared_queue_depth(self) -> int:
        """Requests waiting beyond this process (a broker's shared queue); 0 if none."""

    def worker_status(self) -> list[WorkerStatus]:
        """One entry per model worker."""

    async def backlog(self) -> QueueBacklog | None:
        """The work waiting for workers beyond this process (broker mode: every front
        end's, in Redis); None when all of it waits here (in the Streamer)."""

    async def refresh(self) -> None:
        """Look at the workers now rather than at the next periodic look (a no-op where
        there is nothing to look at). Raises ``BrokerUnavailable`` where what it looks at
        cannot be reached."""

    @property
    def models(self) -> VersionControl:
        """How its workers load model versions, and which serve (``VersionControl``)."""
