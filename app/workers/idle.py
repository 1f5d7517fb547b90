"""The pool's idle workers: last in, first out, taken by what they hold.

At low load the worker that just answered takes the next batch, its caches and OpenMP
threads still warm; under load every worker is busy anyway. A batch waits for an idle worker
that holds its model; a load or unload takes one particular worker out of the rotation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

W = TypeVar("W")


class IdleWorkers(Generic[W]):
    """Idle workers, and the callers waiting for one.

    >>> async def main():
    ...     idle = IdleWorkers()
    ...     idle.put("a"); idle.put("b")
    ...     return await idle.get(lambda w: True), idle.take("a"), idle.take("a")
    >>> asyncio.run(main())
    ('b', True, False)
    """

    def __init__(self) -> None:
        self._idle: list[W] = []
        self._waiting: list[tuple[Callable[[W], bool], asyncio.Future[W | None]]] = []

    def __len__(self) -> int:
        return len(self._idle)

    def put(self, worker: W) -> None:
        """``worker`` is idle: to the first caller waiting for one like it, else kept."""
        for entry in self._waiting:
            wanted, future = entry
            if not future.done() and wanted(worker):
                self._waiting.remove(entry)
                future.set_result(worker)
                return
        self._idle.append(worker)

    async def get(self, wanted: Callable[[W], bool]) -> W | None:
        """The idle worker that became idle last among those ``wanted``, waiting for one if
        need be; ``None`` when ``wake_all`` woke the caller (to look at the pool again)."""
        for position in range(len(self._idle) - 1, -1, -1):
            if wanted(self._idle[position]):
                return self._idle.pop(position)
        future: asyncio.Future[W | None] = asyncio.get_running_loop().create_future()
        entry = (wanted, future)
        self._waiting.append(entry)
        try:
            return await future
        except asyncio.CancelledError:
            # Handed a worker just as the caller was cancelled: it must not be lost.
            if future.done() and not future.cancelled() and future.result() is not None:
                self.put(future.result())  # type: ignore[arg-type]  # not None, checked
            raise
        finally:
            if entry in self._waiting:
                self._waiting.remove(entry)

    def take(self, worker: W) -> bool:
        """Take ``worker`` out if it is idle; whether it was."""
        if worker in self._idle:
            self._idle.remove(worker)
            return True
        return False

    def wake_all(self) -> None:
        """Wake every waiting caller with ``None`` (a worker died: there may be none left)."""
        waiting, self._waiting = self._waiting, []
        for _, future in waiting:
            if not future.done():
                future.set_result(None)
