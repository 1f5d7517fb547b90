"""``app.workers.idle.IdleWorkers``: last in, first out, by what a worker holds, and no
worker lost to a caller that gave up."""

from __future__ import annotations

import asyncio

from app.workers.idle import IdleWorkers


async def test_a_caller_gets_the_last_idle_worker_that_holds_its_model() -> None:
    idle: IdleWorkers[str] = IdleWorkers()
    for worker in ("a-old", "b-new", "c-old"):
        idle.put(worker)
    assert await idle.get(lambda w: w.endswith("new")) == "b-new"
    assert await idle.get(lambda w: True) == "c-old"  # last in, first out
    assert len(idle) == 1


async def test_a_waiting_caller_gets_the_first_worker_like_it_to_come() -> None:
    idle: IdleWorkers[str] = IdleWorkers()
    wants_new = asyncio.create_task(idle.get(lambda w: w.endswith("new")))
    wants_any = asyncio.create_task(idle.get(lambda w: True))
    await asyncio.sleep(0)
    idle.put("a-old")  # the first caller does not want it; the second does
    idle.put("b-new")
    assert await wants_any == "a-old" and await wants_new == "b-new"
    assert len(idle) == 0


async def test_a_worker_handed_to_a_caller_that_was_cancelled_goes_back() -> None:
    idle: IdleWorkers[str] = IdleWorkers()
    waiting = asyncio.create_task(idle.get(lambda w: True))
    await asyncio.sleep(0)
    idle.put("a")  # handed over...
    waiting.cancel()  # ...as the caller gives up, before it could take it
    await asyncio.gather(waiting, return_exceptions=True)
    assert idle.take("a")  # back among the idle ones, not lost


async def test_wake_all_wakes_every_caller_with_none() -> None:
    idle: IdleWorkers[str] = IdleWorkers()
    callers = [asyncio.create_task(idle.get(lambda w: True)) for _ in range(3)]
    await asyncio.sleep(0)
    idle.wake_all()
    assert await asyncio.gather(*callers) == [None, None, None]
    assert not idle.take("nobody")
