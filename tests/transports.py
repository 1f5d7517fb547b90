"""A recording, gateable wrapper around any real transport: tests see the batches the
workers were given and can hold them, through the app's public seam (``create_app(...,
transport=...)``), never by patching the Streamer or the pool."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from app.batching import (
    BatchItem,
    QueueBacklog,
    Transport,
    VersionControl,
    WorkerStatus,
)
from app.engine import default_transport, models_to_serve
from app.jobs import BatchKey, ImageJob
from app.plan import plan_serving
from app.settings import Settings


class Watched:
    """A ``Transport`` that passes everything to ``inner`` and records each batch's key and
    size. ``hold()`` makes it keep every batch it is given until ``release()`` (the workers
    look busy, so later requests pile up in the Streamer's queue where a test can count them).

    >>> # watched = Watched()
    >>> # async with running_app(watched.wrap, **settings) as (app, client):
    >>> #     watched.hold(); ...; await watched.wait_entered()
    """

    def __init__(self) -> None:
        self._inner: Transport[ImageJob] | None = None
        self.batches: list[tuple[BatchKey, int]] = []
        self._open = asyncio.Event()
        self._open.set()
        self._entered = asyncio.Event()
        self.held = 0

    def wrap(self, settings: Settings) -> Watched:
        """Wrap the transport ``settings`` ask for (as the app would build it); returns self."""
        plan = plan_serving(settings)
        self._inner = default_transport(plan, models_to_serve(plan))
        return self

    @property
    def inner(self) -> Transport[ImageJob]:
        assert self._inner is not None, "wrap() a transport first"
        return self._inner

    def sizes(self, task: str) -> Counter[int]:
        """How many batches of each size ran for ``task`` ("embedding" or "tag")."""
        return Counter(size for key, size in self.batches if key.task == task)

    def hold(self) -> None:
        self.held = 0  # items in the batches held since
        self._open.clear()
        self._entered.clear()

    def release(self) -> None:
        self._open.set()

    async def wait_entered(self) -> None:
        """Until a batch is being held."""
        await asyncio.wait_for(self._entered.wait(), 10)

    async def run_batch(
        self, key: Hashable, items: Sequence[BatchItem[ImageJob]]
    ) -> Mapping[int, Any]:
        assert isinstance(key, BatchKey)
        if not self._open.is_set():
            self.held += len(items)
            self._entered.set()
            await self._open.wait()
        self.batches.append((key, len(items)))
        return await self.inner.run_batch(key, items)

    async def start(self) -> None:
        await self.inner.start()

    async def aclose(self) -> None:
        self._open.set()
        await self.inner.aclose()

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def batch_size(self) -> int:
        return self.inner.batch_size

    def batch_size_for(self, key: Hashable) -> int:
        return self.inner.batch_size_for(key)

    @property
    def models(self) -> VersionControl:
        return self.inner.models

    async def backlog(self) -> QueueBacklog | None:
        return await self.inner.backlog()

    async def refresh(self) -> None:
        await self.inner.refresh()

    @property
    def ready(self) -> bool:
        return self.inner.ready

    @property
    def shared_queue_depth(self) -> int:
        return self.inner.shared_queue_depth

    def worker_status(self) -> list[WorkerStatus]:
        return self.inner.worker_status()


async def wait_queued(app: Any, count: int) -> None:
    """Until ``count`` items wait in the app's queue (while batches are held)."""
    async with asyncio.timeout(20):
        while app.state.engine.streamer.queue_depth < count:
            await asyncio.sleep(0.005)
