"""Waiting in a test for a state of the system under test, not for a fixed time: a busy host
(a full suite beside it on 2 cores) stretches every step."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


async def wait_for(condition: Any, timeout_s: float = 20, what: str = "condition") -> None:
    """Poll ``condition`` (in a thread: it may wait on a socket) every 0.1 s until it holds;
    AssertionError naming ``what`` once ``timeout_s`` have passed."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(condition):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def soon(predicate: Callable[[], bool], timeout_s: float = 5) -> None:
    """Poll, on the loop itself every millisecond, a condition the test caused in this
    process (bounded, so that a bug fails instead of hanging)."""
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.001)
