"""The seam between a worker pool and its host (``app.workers.hosting.PoolHost``): what the
host needs of the pool's workers (``PoolWorker``) and has the pool do with them (``Hands``),
filled by ``app.workers.pool.WorkerPool`` and ``app.testing.FakeTransport``; and a worker as
the lifecycle's rules see it (``PoolWorkerView``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from app.lifecycle import ModelSpec, VersionLife
from app.workers.messages import ModelLoaded

# A load of (name, version) on a worker ended after seconds; the step it failed at, or None.
LoadObserver = Callable[[str, int, float, str | None], None]


class PoolWorker(Protocol):
    """A worker as its host needs it (``app.workers.handle.WorkerHandle``, a fake)."""

    @property
    def index(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def alive(self) -> bool: ...
    @property
    def ready(self) -> bool: ...


class Hands(Protocol):
    """What a pool does on its host's word."""

    def host_workers(self) -> Sequence[PoolWorker]:
        """Its workers now (one per slot; a restarted one is a new object)."""

    async def load_on(self, worker: PoolWorker, spec: ModelSpec) -> ModelLoaded:
        """Load ``spec`` on ``worker`` beside what it holds; its report. Raises
        ``ModelLoadFailed`` (or ``ModelMemoryBudget``) with the step it failed at."""

    async def unload_on(self, worker: PoolWorker, served_id: str) -> None:
        """Drop ``served_id`` from ``worker``, its memory given back."""


@dataclass(frozen=True)
class PoolWorkerView:
    """One pool worker as the lifecycle's rules see it (``app.lifecycle.WorkerView``)."""

    name: str
    alive: bool
    models: tuple[VersionLife, ...] = field(default_factory=tuple)
    draining: bool = False
    aimed: int = 0
