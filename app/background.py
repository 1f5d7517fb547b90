"""Tasks started and not awaited: asyncio keeps only weak references to them, so they are
held here until they end, and can be waited for (bounded) or cancelled before what they use
closes."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Background:
    """The tasks one owner started in the background.

    >>> # background = Background()
    >>> # background.start(client.xdel(stream, entry_id))
    >>> # await background.settle(timeout_s=2)   # before the client closes
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def start(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def cancel(self) -> None:
        """Cancel the tasks running now, and wait for them to end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def settle(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` for the tasks running now."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s)
