"""``FakeTransport``: the whole server, routes to Streamer, without model workers.

In the spirit of httpx's ``MockTransport``: a function answers each batch, so a test (or a
user trying the API) drives the real app through its public seam instead of patching it::

    def answer(task: Task, jobs: Sequence[ImageJob]) -> list[object]:
        return [np.zeros(8, np.float32) for _ in jobs]      # or TopK(...) for Task.TAG

    app = create_app(settings, transport=FakeTransport(answer))

Each job's ``image`` is pixels (uint8, the model's input size) or, where the serving plan
leaves uploads to the workers, the encoded upload (``bytes``): decode it with
``app.images.preprocess`` as a worker would. ``batches`` records what ran, in order; each
batch's ``key.model`` is the served id of the model version it was admitted for. Its one
fake worker loads and unloads versions as the real pool's do, through the same host
(``app.workers.hosting.PoolHost``: ``models``), instantly, or failing with ``fail_loads``'
error; ``loaded`` lists the served ids it holds.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.batching import BatchItem, HeldModel, QueueBacklog, WorkerStatus
from app.errors import BatchContractError, ModelLoadFailed
from app.jobs import BatchKey, ImageJob, Task
from app.lifecycle import ModelSpec
from app.workers.hands import PoolWorker
from app.workers.hosting import PoolHost
from app.workers.messages import ModelLoaded

Handler = Callable[[Task, Sequence[ImageJob]], Sequence[object] | Awaitable[Sequence[object]]]


@dataclass(frozen=True)
class FakeBatch:
    """One batch a ``FakeTransport`` ran: its key, its jobs and each item's deadline."""

    key: BatchKey
    jobs: tuple[ImageJob, ...]
    deadlines: tuple[float | None, ...]


@dataclass
class FakeWorker:
    """The one worker of a ``FakeTransport``."""

    index: int = 0
    device: str = "fake"
    alive: bool = False
    ready: bool = False


class FakeTransport:
    """An ``app.batching.Transport`` whose batches ``handler(task, jobs)`` answers, one
    result per job in order (an exception instance fails that job alone; raising fails the
    batch). ``batch_size`` and ``capacity`` shape the batches the Streamer forms."""

    def __init__(self, handler: Handler, *, batch_size: int = 8, capacity: int = 1) -> None:
        self.handler = handler
        self._batch_size = batch_size
        self._capacity = capacity
        self.batches: list[FakeBatch] = []
        self.started = self.closed = False
        self.loaded: list[str] = []  # served ids held, in load order
        self.fail_loads: ModelLoadFailed | None = None  # set: every load fails with it
        self.worker = FakeWorker()
        self.host = PoolHost(self)

    # -- what its host has its worker do -----------------------------------------------------

    def host_workers(self) -> Sequence[PoolWorker]:
        return [self.worker]

    async def load_on(self, worker: PoolWorker, spec: ModelSpec) -> ModelLoaded:
        """Hold ``spec`` (or fail with ``fail_loads``), in the precision it asks (a fake
        computes in none: fp32 for ``auto``)."""
        if self.fail_loads is not None:
            raise self.fail_loads
        if spec.served_id not in self.loaded:
            self.loaded.append(spec.served_id)
        dtype = "float32" if spec.dtype == "auto" else spec.dtype
        return ModelLoaded(spec.served_id, self._batch_size, "fake", 0, dtype=dtype)

    async def unload_on(self, worker: PoolWorker, served_id: str) -> None:
        if served_id in self.loaded:
            self.loaded.remove(served_id)

    # -- the Transport -----------------------------------------------------------------------

    async def start(self) -> None:
        self.started = True
        self.worker.alive = self.worker.ready = True
        await self.host.start(timeout_s=30)

    async def aclose(self) -> None:
        self.closed = True
        self.worker.alive = False
        await self.host.aclose()

    async def run_batch(
        self, key: Hashable, items: Sequence[BatchItem[ImageJob]]
    ) -> Mapping[int, Any]:
        assert isinstance(key, BatchKey)
        jobs = tuple(item.payload for item in items)
        self.batches.append(FakeBatch(key, jobs, tuple(item.deadline for item in items)))
        answered = self.handler(key.task, jobs)
        results = await answered if inspect.isawaitable(answered) else answered
        if len(results) != len(items):
            raise BatchContractError(f"the handler answered {len(results)} of {len(items)} jobs")
        return {item.id: result for item, result in zip(items, results, strict=True)}

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def batch_size_for(self, key: Hashable) -> int:
        return self._batch_size

    @property
    def ready(self) -> bool:
        return self.started and not self.closed

    @property
    def shared_queue_depth(self) -> int:
        return 0

    async def backlog(self) -> QueueBacklog | None:
        return None

    async def refresh(self) -> None:
        pass

    @property
    def models(self) -> PoolHost:
        return self.host

    def worker_status(self) -> list[WorkerStatus]:
        items = sum(len(batch.jobs) for batch in self.batches)
        keeper = next(iter(self.host.keepers.values()), None)
        held = [
            HeldModel(
                v.served_id, v.state.shown, "fake", self._batch_size, name=v.name,
                version=v.version, reason=f"{v.step}: {v.reason}" if v.step else v.reason,
            )
            for v in (keeper.held() if keeper is not None else [])
        ]  # fmt: skip
        return [
            WorkerStatus(
                index=0, device="fake", threads=0, pid=None, ready=self.ready,
                alive=not self.closed, batch_size=self._batch_size, batches=len(self.batches),
                items=items, models=tuple(held),
            )
        ]  # fmt: skip
