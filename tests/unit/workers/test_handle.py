"""A worker process seen from the pool: waiting for it to exit."""

from __future__ import annotations

import asyncio
import os

from app.workers.handle import wait_for_exit


def test_waiting_for_a_worker_to_exit_outlasts_its_sentinel() -> None:
    """A process closes its sentinel while it exits, a moment before it can be reaped: the
    pool must not take it for one that did not stop (and kill it)."""
    read_end, write_end = os.pipe()

    class Exiting:
        sentinel = read_end
        closed = False  # the sentinel's write end, as at exit
        polls_after_close = 3  # then it can be reaped

        def is_alive(self) -> bool:
            if self.closed:
                self.polls_after_close = max(0, self.polls_after_close - 1)
            return self.polls_after_close > 0

        def close_sentinel(self) -> None:
            os.close(write_end)
            self.closed = True

    async def scenario() -> float:
        process = Exiting()
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, process.close_sentinel)
        started = loop.time()
        await wait_for_exit(process, 5.0)  # type: ignore[arg-type]
        assert not process.is_alive()
        return loop.time() - started

    try:
        assert asyncio.run(scenario()) < 1.0
    finally:
        os.close(read_end)
