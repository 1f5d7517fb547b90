"""Priorities and fair batches (``app.batching.fair`` and the Streamer's levels): which items a
batch takes, from which tenants, and which work is refused (429) when the queue is full."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from app.batching import LevelPolicy, Streamer, Ticket
from app.batching.fair import FairQueue
from app.errors import QueueFull, Shed
from tests.unit.test_streamer import FakeModel
from tests.waiting import soon


@dataclass(eq=False)
class Item:
    tenant: str
    level: int = 0
    weight: float = 1.0
    key: Hashable = "k"
    name: str = ""
    enqueued_at: float = field(default=0.0)


def queue_of(*groups: tuple[str, int, float, int], levels: int = 1) -> FairQueue[Item]:
    """(tenant, count, weight, level) groups, each tenant's items in order."""
    queue: FairQueue[Item] = FairQueue(levels)
    stamp = 0.0
    for tenant, count, weight, level in groups:
        for i in range(count):
            stamp += 1
            queue.append(Item(tenant, level, weight, name=f"{tenant}{i}", enqueued_at=stamp))
    return queue


def tenants(batch: Sequence[Item]) -> Counter[str]:
    return Counter(item.tenant for item in batch)


def always(item: Item) -> bool:
    return True


def test_a_tenant_with_a_backlog_gives_its_share_of_each_batch_not_the_batch() -> None:
    queue = queue_of(("bulk", 1000, 1.0, 0), ("shop", 6, 1.0, 0))
    batches = [queue.take("k", 4, always) for _ in range(3)]
    assert [tenants(batch) for batch in batches] == [Counter(bulk=2, shop=2)] * 3
    assert [item.name for item in batches[0]] == ["bulk0", "shop0", "bulk1", "shop1"]
    after = queue.take("k", 4, always)
    assert tenants(after) == Counter(bulk=4)  # shop has nothing left: bulk takes the batch


def test_weights_share_a_batch_in_their_proportion_across_batches() -> None:
    queue = queue_of(("shop", 100, 3.0, 0), ("bulk", 100, 1.0, 0))
    taken: Counter[str] = Counter()
    for _ in range(10):  # batches of 6 that cut turns short: the credit carries over
        taken += tenants(queue.take("k", 6, always))
    assert taken == Counter(shop=45, bulk=15)


def test_a_weight_below_one_waits_for_its_credit() -> None:
    queue = queue_of(("big", 100, 1.0, 0), ("small", 100, 0.25, 0))
    taken: Counter[str] = Counter()
    for _ in range(25):
        taken += tenants(queue.take("k", 2, always))
    assert taken == Counter(big=40, small=10)


def test_higher_levels_go_first_and_lower_ones_fill_what_is_left() -> None:
    queue = queue_of(("bulk", 5, 1.0, 1), ("shop", 3, 1.0, 0), levels=2)
    assert queue.head() is not None and queue.head().tenant == "shop"  # type: ignore[union-attr]
    first = queue.take("k", 4, always)
    assert [item.name for item in first] == ["shop0", "shop1", "shop2", "bulk0"]
    assert [item.name for item in queue.take("k", 8, always)] == [f"bulk{i}" for i in (1, 2, 3, 4)]
    assert len(queue) == 0


def test_items_of_another_kind_stay_in_their_place() -> None:
    queue: FairQueue[Item] = FairQueue(1)
    for i, key in enumerate(["a", "b", "a", "b"]):
        queue.append(Item("t", key=key, name=f"{key}{i}"))
    assert [item.name for item in queue.take("b", 8, always)] == ["b1", "b3"]
    assert [item.name for item in queue] == ["a0", "a2"]


def test_unusable_items_leave_the_queue_without_a_slot() -> None:
    queue = queue_of(("t", 4, 1.0, 0))
    batch = queue.take("k", 2, lambda item: item.name != "t0")
    assert [item.name for item in batch] == ["t1", "t2"] and len(queue) == 1


def test_the_newest_of_the_lowest_level_gives_way() -> None:
    queue = queue_of(("shop", 2, 1.0, 0), ("bulk", 2, 1.0, 1), ("other", 1, 1.0, 1), levels=2)
    lower = queue.newest_below(0)
    assert lower is not None and lower.name == "other0"
    assert queue.newest_below(1) is None  # nothing below the lowest level


def test_removing_a_tenants_last_item_takes_it_out_of_the_turn() -> None:
    queue = queue_of(("a", 1, 1.0, 0), ("b", 1, 1.0, 0))
    (first,) = [item for item in queue if item.tenant == "a"]
    assert queue.remove(first) and not queue.remove(first)
    assert queue.head() is not None and queue.head().tenant == "b"  # type: ignore[union-attr]


# -- the Streamer's levels ------------------------------------------------------------------


def ticket(tenant: str, level: int = 0) -> Ticket:
    return Ticket(tenant=tenant, level=level)


async def busy(streamer: Streamer[Any, Any], model: FakeModel) -> asyncio.Task[Any]:
    """Occupy the only batch slot, so what is submitted next waits in the queue."""
    blocker = asyncio.create_task(streamer.submit("blocker", ticket=ticket("x")))
    await model.started.wait()
    return blocker


def test_batches_are_fair_across_tenants_in_the_streamer() -> None:
    async def run() -> list[tuple[Hashable, list[object]]]:
        model = FakeModel(gated=True)
        async with Streamer[Any, Any](model, max_batch_size=4, max_latency_s=10) as streamer:
            blocker = await busy(streamer, model)
            tasks = [
                asyncio.create_task(streamer.submit(f"bulk{i}", ticket=ticket("bulk")))
                for i in range(8)
            ] + [asyncio.create_task(streamer.submit(f"shop{i}", ticket=ticket("shop")))
                 for i in range(2)]  # fmt: skip
            await soon(lambda: streamer.queue_depth == 10)
            model.release.set()
            await asyncio.gather(blocker, *tasks)
            return model.batches

    batches = asyncio.run(run())
    assert batches[1][1] == ["bulk0", "shop0", "bulk1", "shop1"]  # not bulk0..bulk3


def test_a_lower_levels_bound_refuses_it_with_429_and_the_top_levels_with_503() -> None:
    levels = (LevelPolicy(max_queue=2), LevelPolicy(max_queue=1))

    async def run() -> tuple[Shed, QueueFull]:
        model = FakeModel(gated=True)
        async with Streamer[Any, Any](
            model, max_batch_size=8, max_latency_s=10, levels=levels
        ) as streamer:
            blocker = await busy(streamer, model)
            queued = [
                asyncio.create_task(streamer.submit(n, ticket=ticket("t", level)))
                for n, level in (("low", 1), ("top0", 0), ("top1", 0))
            ]
            await soon(lambda: streamer.queue_depth == 3)
            with pytest.raises(Shed) as low:
                await streamer.submit("low2", ticket=ticket("t", 1))
            with pytest.raises(QueueFull) as top:
                await streamer.submit("top2", ticket=ticket("t", 0))
            model.release.set()
            await asyncio.gather(blocker, *queued)
            return low.value, top.value

    low, top = asyncio.run(run())
    assert "priority 2's queue is full (1 waiting)" in low.message
    assert "priority 1's queue is full (2 waiting)" in top.message


def test_a_full_queue_refuses_its_newest_low_priority_item_to_take_a_high_one() -> None:
    levels = (LevelPolicy(), LevelPolicy())

    async def run() -> tuple[list[Any], FakeModel]:
        model = FakeModel(gated=True)
        async with Streamer[Any, Any](
            model, max_batch_size=8, max_latency_s=10, max_queue_size=2, levels=levels
        ) as streamer:
            blocker = await busy(streamer, model)
            lows = [
                asyncio.create_task(streamer.submit(f"low{i}", ticket=ticket("bulk", 1)))
                for i in range(2)
            ]
            await soon(lambda: streamer.queue_depth == 2)
            high = asyncio.create_task(streamer.submit("high", ticket=ticket("shop", 0)))
            await soon(lambda: lows[1].done())
            with pytest.raises(Shed):  # and a low one cannot push in now
                await streamer.submit("low2", ticket=ticket("bulk", 1))
            model.release.set()
            results = await asyncio.gather(blocker, *lows, high, return_exceptions=True)
            return list(results), model

    results, model = asyncio.run(run())
    assert isinstance(results[2], Shed) and "higher priorities come first" in results[2].message
    assert results[1] == ("default", "low0") and results[3] == ("default", "high")
    assert model.batches[1][1] == ["high", "low0"]


@pytest.mark.parametrize("action", ["reject", "delay"])
def test_a_levels_queue_timeout_refuses_or_delays(action: str) -> None:
    levels = (LevelPolicy(), LevelPolicy(timeout_s=0.5, on_timeout=action))  # type: ignore[arg-type]

    async def run() -> tuple[list[Any], FakeModel]:
        model = FakeModel(gated=True)
        async with Streamer[Any, Any](
            model, max_batch_size=1, max_latency_s=10, levels=levels
        ) as streamer:
            blocker = await busy(streamer, model)
            low = asyncio.create_task(streamer.submit("low", ticket=ticket("bulk", 1)))
            await asyncio.sleep(1.0)  # past its level's queue timeout (later-low: well within)
            later = asyncio.create_task(streamer.submit("later-low", ticket=ticket("bulk", 1)))
            await soon(lambda: streamer.queue_depth == (2 if action == "delay" else 1))
            model.release.set()
            results = await asyncio.gather(blocker, low, later, return_exceptions=True)
            return list(results), model

    results, model = asyncio.run(run())
    if action == "reject":
        assert isinstance(results[1], Shed) and "waits at most 0.5 s" in results[1].message
        assert [payloads for _, payloads in model.batches] == [["blocker"], ["later-low"]]
    else:  # still answered, after the item that did not time out
        assert results[1] == ("default", "low")
        assert [payloads for _, payloads in model.batches][1:] == [["later-low"], ["low"]]


def test_a_priority_outside_the_levels_is_a_bug_not_a_request_error() -> None:
    async def run() -> None:
        async with Streamer[Any, Any](FakeModel(), max_batch_size=1, max_latency_s=0) as s:
            with pytest.raises(ValueError, match="priority level 3"):
                await s.submit("x", ticket=ticket("t", 3))

    asyncio.run(run())


def test_a_full_level_is_shared_out_the_tenant_holding_most_gives_way() -> None:
    queue = queue_of(("bulk", 3, 1.0, 0), ("shop", 1, 1.0, 0))
    heavy = queue.heaviest(0, "shop")
    assert heavy is not None and heavy.name == "bulk2"  # bulk 3 > shop's 1 + 1
    assert queue.heaviest(0, "bulk") is None  # the heaviest itself gives way to nobody
    even = queue_of(("bulk", 2, 1.0, 0), ("shop", 1, 1.0, 0))
    assert even.heaviest(0, "shop") is None  # 2 is not more than shop's 1 + 1
    weighted = queue_of(("bulk", 3, 3.0, 0), ("shop", 1, 1.0, 0))
    assert weighted.heaviest(0, "shop") is None  # 3 for a weight of 3 is its share


def test_the_tenant_holding_most_is_judged_for_its_weight_and_a_tie_is_the_server_s() -> None:
    """Found by a review: raw counts said shop (6 for a weight of 4) held the most, so bulk
    (2 for a weight of 1, over its share) heard 503 'the server is full' and might move to
    another replica; and two tenants holding as much each heard 429, where a 503 is due."""
    weighted = queue_of(("shop", 6, 4.0, 0), ("bulk", 2, 1.0, 0))
    assert weighted.holds_most(0, "bulk", 1.0) and not weighted.holds_most(0, "shop", 4.0)
    even = queue_of(("a", 4, 1.0, 0), ("b", 4, 1.0, 0))
    assert not even.holds_most(0, "a") and not even.holds_most(0, "b")


def test_a_noisy_tenant_at_a_full_level_cannot_keep_a_quiet_one_out() -> None:
    levels = (LevelPolicy(max_queue=3),)

    async def run() -> tuple[list[Any], FakeModel]:
        model = FakeModel(gated=True)
        async with Streamer[Any, Any](
            model, max_batch_size=8, max_latency_s=10, levels=levels
        ) as streamer:
            blocker = await busy(streamer, model)
            noisy = [
                asyncio.create_task(streamer.submit(f"bulk{i}", ticket=ticket("bulk")))
                for i in range(3)
            ]
            await soon(lambda: streamer.queue_depth == 3)
            with pytest.raises(QueueFull):  # one tenant alone: the server is full
                await streamer.submit("bulk3", ticket=ticket("bulk"))
            quiet = asyncio.create_task(streamer.submit("shop0", ticket=ticket("shop")))
            await soon(lambda: noisy[2].done())
            with pytest.raises(Shed, match="its tenant holds the most"):  # bulk's excess now
                await streamer.submit("bulk4", ticket=ticket("bulk"))
            model.release.set()
            results = await asyncio.gather(blocker, *noisy, quiet, return_exceptions=True)
            return list(results), model

    results, model = asyncio.run(run())
    assert isinstance(results[3], Shed) and "its tenant holds the most" in results[3].message
    assert results[4] == ("default", "shop0")
    assert model.batches[1][1] == ["bulk0", "shop0", "bulk1"]


def test_a_levels_max_batch_keeps_batches_with_its_work_short() -> None:
    queue = queue_of(("shop", 2, 1.0, 0), ("bulk", 10, 1.0, 1), levels=2)
    limits = (None, 3)
    first = queue.take("k", 8, always, limits)
    assert [item.name for item in first] == ["shop0", "shop1", "bulk0"]  # bulk joins below 3
    assert [item.name for item in queue.take("k", 8, always, limits)] == ["bulk1", "bulk2", "bulk3"]
    queue.append(Item("shop", 0, name="shop2"))
    assert len(queue.take("k", 8, always, limits)) == 3  # shop2, then bulk up to 3


def test_delayed_work_runs_in_whole_batches_not_under_the_last_level_s_max_batch() -> None:
    """Found by a review: the delayed level took the last level's max_batch, so delayed
    work ran one image a batch with nothing else waiting, and ran out of its deadlines."""
    queue = queue_of(("late", 5, 1.0, 2), levels=2)  # level 2: the delayed one
    assert len(queue.take("k", 8, always, (None, 1))) == 5


def test_a_tenant_left_alone_mid_batch_carries_no_credit_into_the_next_one() -> None:
    """bulk is left alone in its level when tiny empties, with slots to fill: it takes them,
    but owes nothing when late comes; the next batch alternates again (bulk used to carry
    the unused credit of "alone" over, 7 images to late's 1)."""
    queue = queue_of(("shop", 5, 1.0, 0), ("bulk", 10, 1.0, 1), ("tiny", 1, 1.0, 1), levels=2)
    assert tenants(queue.take("k", 8, always)) == Counter(shop=5, bulk=2, tiny=1)
    for i in range(3):
        queue.append(Item("late", 1, name=f"late{i}"))
    assert tenants(queue.take("k", 8, always)) == Counter(bulk=5, late=3)
