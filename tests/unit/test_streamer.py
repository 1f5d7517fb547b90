"""The Streamer against a fake batch function: deterministic, no processes, no torch."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import pytest

from app.batching import BatchItem, Streamer
from app.errors import (
    BatchContractError,
    DeadlineExceeded,
    InferenceError,
    InvalidImage,
    NotReady,
    QueueFull,
    WorkerDied,
)
from tests.waiting import soon

Echo = tuple[Hashable, object]  # what FakeModel answers for each item: (key, payload)


class FakeModel:
    """Records every batch; optionally holds batches until ``release`` is set."""

    def __init__(self, *, gated: bool = False) -> None:
        self.batches: list[tuple[Hashable, list[object]]] = []
        self.release = asyncio.Event()
        if not gated:
            self.release.set()
        self.started = asyncio.Event()

    async def __call__(
        self, key: Hashable, items: Sequence[BatchItem[object]]
    ) -> dict[int, object]:
        self.batches.append((key, [item.payload for item in items]))
        self.started.set()
        await self.release.wait()
        return {item.id: (key, item.payload) for item in items}

    @property
    def sizes(self) -> list[int]:
        return [len(payloads) for _, payloads in self.batches]


async def as_one_batch(batch_fn: Any, payloads: list[Any]) -> tuple[list[Any], list[int]]:
    """Submit ``payloads`` while the only worker is busy, so they wait and then reach
    ``batch_fn`` together as one batch; returns each result or exception, and the sizes of
    the batches ``batch_fn`` was given (a retried batch shows as its items one by one)."""
    model = FakeModel(gated=True)
    sizes: list[int] = []

    async def blocker_then_batch_fn(key: Hashable, items: Sequence[BatchItem[Any]]) -> Any:
        if not model.batches:  # the first batch: the blocker
            return await model(key, items)
        sizes.append(len(items))
        return await batch_fn(key, items)

    async with Streamer[Any, Any](
        blocker_then_batch_fn, max_batch_size=8, max_latency_s=10
    ) as streamer:
        blocker = asyncio.create_task(streamer.submit("blocker"))
        await model.started.wait()
        tasks = [asyncio.create_task(streamer.submit(p)) for p in payloads]
        await soon(lambda: streamer.queue_depth == len(payloads))
        model.release.set()
        await blocker
        results = await asyncio.gather(*tasks, return_exceptions=True)
    return results, sizes


async def test_concurrent_items_are_batched_and_each_caller_gets_its_own_result() -> None:
    model = FakeModel(gated=True)
    async with Streamer[object, Echo](model, max_batch_size=8, max_latency_s=10) as streamer:
        first = asyncio.create_task(streamer.submit(-1))
        await model.started.wait()  # the only worker is now busy with item -1
        rest = [asyncio.create_task(streamer.submit(i)) for i in range(20)]
        await soon(lambda: streamer.queue_depth == 20)
        model.release.set()
        results = await asyncio.gather(first, *rest)
    assert results == [("default", i) for i in range(-1, 20)]
    assert model.sizes == [1, 8, 8, 4]  # capped at max_batch_size, FIFO order kept
    assert [p for _, batch in model.batches for p in batch] == list(range(-1, 20))


async def test_128_waiting_requests_form_one_batch_of_128() -> None:
    model = FakeModel(gated=True)
    async with Streamer[object, Echo](
        model, max_batch_size=128, max_latency_s=10, max_queue_size=1000
    ) as s:
        blocker = asyncio.create_task(s.submit("block"))
        await model.started.wait()
        waiting = [asyncio.create_task(s.submit(i)) for i in range(128)]
        await soon(lambda: s.queue_depth == 128)
        model.release.set()
        await asyncio.gather(blocker, *waiting)
    assert model.sizes == [1, 128]


async def test_lone_request_on_idle_server_does_not_wait_for_max_latency() -> None:
    model = FakeModel()
    async with Streamer[object, Echo](model, max_batch_size=64, max_latency_s=30) as streamer:
        started = time.monotonic()
        assert await streamer.submit("x") == ("default", "x")
        # 30 s of max latency must not be spent: the batch left at once.
        assert time.monotonic() - started < 1.0
    assert model.sizes == [1]


async def test_free_worker_waits_at_most_max_latency_while_another_batch_runs() -> None:
    # Two workers: one busy; a new item may wait to fill a batch, but only max_latency_s.
    calls: list[tuple[str, float]] = []
    release = asyncio.Event()

    async def model(key: Hashable, items: Sequence[BatchItem[str]]) -> dict[int, str]:
        calls.append((items[0].payload, time.monotonic()))
        if items[0].payload == "slow":
            await release.wait()
        return {item.id: item.payload for item in items}

    async with Streamer[str, str](
        model, max_batch_size=8, max_latency_s=0.2, max_concurrent_batches=2
    ) as s:
        slow = asyncio.create_task(s.submit("slow"))
        await soon(lambda: s.in_flight == 1)
        submitted = time.monotonic()
        assert await s.submit("late") == "late"
        waited = calls[1][1] - submitted
        release.set()
        await slow
    assert 0.2 <= waited < 2.0


async def test_full_batch_leaves_without_waiting_for_max_latency() -> None:
    release = asyncio.Event()

    async def model(key: Hashable, items: Sequence[BatchItem[int]]) -> dict[int, int]:
        if items[0].payload == -1:
            await release.wait()
        return {item.id: item.payload for item in items}

    async with Streamer[int, int](
        model, max_batch_size=4, max_latency_s=30, max_concurrent_batches=2
    ) as s:
        blocker = asyncio.create_task(s.submit(-1))
        await soon(lambda: s.in_flight == 1)
        started = time.monotonic()
        assert await asyncio.gather(*(s.submit(i) for i in range(4))) == [0, 1, 2, 3]
        assert time.monotonic() - started < 5.0
        release.set()
        await blocker


async def test_items_with_different_keys_never_share_a_batch() -> None:
    model = FakeModel(gated=True)
    async with Streamer[object, Echo](model, max_batch_size=16, max_latency_s=10) as streamer:
        blocker = asyncio.create_task(streamer.submit(0, key="tag"))
        await model.started.wait()
        tasks = [
            asyncio.create_task(streamer.submit(i, key="tag" if i % 2 else "embedding"))
            for i in range(1, 11)
        ]
        await soon(lambda: streamer.queue_depth == 10)
        model.release.set()
        results = await asyncio.gather(blocker, *tasks)
    for key, payloads in model.batches:
        assert all(
            isinstance(p, int) and ("tag" if p % 2 or p == 0 else "embedding") == key
            for p in payloads
        )
    assert results[1:] == [("tag" if i % 2 else "embedding", i) for i in range(1, 11)]
    assert sorted((str(key), len(payloads)) for key, payloads in model.batches) == [
        ("embedding", 5),
        ("tag", 1),
        ("tag", 5),
    ]


async def test_each_key_batches_up_to_its_own_size() -> None:
    """Two models with their own largest batch (``batch_size_for``): each key's batches stop
    there, never above ``max_batch_size``."""
    model = FakeModel(gated=True)
    sizes: dict[Hashable, int] = {"small": 3, "big": 100}
    async with Streamer[object, Echo](
        model, max_batch_size=8, max_latency_s=10, batch_size_for=sizes.__getitem__
    ) as streamer:
        blocker = asyncio.create_task(streamer.submit(0, key="small"))
        await model.started.wait()
        tasks = [
            asyncio.create_task(streamer.submit(i, key="small" if i % 2 else "big"))
            for i in range(1, 21)
        ]
        await soon(lambda: streamer.queue_depth == 20)
        model.release.set()
        await asyncio.gather(blocker, *tasks)
    by_key = sorted((str(key), len(payloads)) for key, payloads in model.batches)
    assert by_key == [
        ("big", 2),
        ("big", 8),
        ("small", 1),
        ("small", 1),
        ("small", 3),
        ("small", 3),
        ("small", 3),
    ]
    assert streamer.batch_size("small") == 3 and streamer.batch_size("big") == 8


async def test_full_queue_rejects_at_once_with_retry_after() -> None:
    model = FakeModel(gated=True)
    async with Streamer[object, Echo](
        model, max_batch_size=2, max_latency_s=10, max_queue_size=3
    ) as streamer:
        blocker = asyncio.create_task(streamer.submit("b"))
        await model.started.wait()
        queued = [asyncio.create_task(streamer.submit(i)) for i in range(3)]
        await soon(lambda: streamer.queue_depth == 3)
        started = time.monotonic()
        with pytest.raises(QueueFull) as info:
            await streamer.submit("one too many")
        assert time.monotonic() - started < 2.0  # at once: waiting for room would hang
        assert info.value.retry_after_s >= 1
        assert streamer.queue_depth == 3  # the refused item never joined the queue
        model.release.set()
        await asyncio.gather(blocker, *queued)


async def test_deadline_expires_while_queued_and_item_is_never_computed() -> None:
    model = FakeModel(gated=True)
    async with Streamer[object, Echo](model, max_batch_size=4, max_latency_s=10) as streamer:
        blocker = asyncio.create_task(streamer.submit("blocker"))
        await model.started.wait()
        with pytest.raises(DeadlineExceeded):
            await streamer.submit("doomed", timeout_s=0.05)
        assert streamer.queue_depth == 0
        model.release.set()
        await blocker
        assert await streamer.submit("after") == ("default", "after")
    assert all("doomed" not in payloads for _, payloads in model.batches)


async def test_cancelled_caller_leaves_the_queue() -> None:
    model = FakeModel(gated=True)
    async with Streamer[object, Echo](model, max_batch_size=4, max_latency_s=10) as streamer:
        blocker = asyncio.create_task(streamer.submit("blocker"))
        await model.started.wait()
        gone = asyncio.create_task(streamer.submit("gone"))
        await soon(lambda: streamer.queue_depth == 1)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert streamer.queue_depth == 0
        model.release.set()
        await blocker
    assert all("gone" not in payloads for _, payloads in model.batches)


async def test_exception_in_batch_reaches_every_caller() -> None:
    async def broken(key: Hashable, items: Sequence[BatchItem[int]]) -> dict[int, int]:
        raise RuntimeError("boom")

    async with Streamer[int, int](broken, max_batch_size=8, max_latency_s=0.01) as streamer:
        results = await asyncio.gather(
            *(streamer.submit(i) for i in range(5)), return_exceptions=True
        )
        # The Streamer keeps working after a failed batch.
        with pytest.raises(InferenceError):
            await streamer.submit(9)
    assert len(results) == 5
    assert all(isinstance(r, InferenceError) for r in results)


async def test_domain_error_from_batch_is_passed_through_unchanged() -> None:
    async def refuses(key: Hashable, items: Sequence[BatchItem[int]]) -> dict[int, int]:
        raise InvalidImage("nope")

    async with Streamer[int, int](refuses, max_batch_size=8, max_latency_s=0.01) as streamer:
        with pytest.raises(InvalidImage, match="nope"):
            await streamer.submit(1)


async def test_per_item_exception_fails_only_that_item() -> None:
    async def picky(key: Hashable, items: Sequence[BatchItem[int]]) -> dict[int, object]:
        return {i.id: InvalidImage("odd") if i.payload % 2 else i.payload for i in items}

    async with Streamer[int, object](picky, max_batch_size=8, max_latency_s=0.01) as streamer:
        results = await asyncio.gather(
            *(streamer.submit(i) for i in range(4)), return_exceptions=True
        )
    assert results[0] == 0 and results[2] == 2
    assert isinstance(results[1], InvalidImage) and isinstance(results[3], InvalidImage)


async def test_failed_batch_is_retried_item_by_item_so_only_the_poison_one_fails() -> None:
    calls: list[list[str]] = []

    async def fragile(key: Hashable, items: Sequence[BatchItem[str]]) -> dict[int, str]:
        calls.append([item.payload for item in items])
        if any(item.payload == "poison" for item in items):
            raise RuntimeError("model crashed")
        return {item.id: item.payload.upper() for item in items}

    payloads = ["a", "poison", "b", "c"]
    results, sizes = await as_one_batch(fragile, payloads)
    assert results[0] == "A" and results[2] == "B" and results[3] == "C"
    assert isinstance(results[1], InferenceError)
    assert calls == [payloads, ["a"], ["poison"], ["b"], ["c"]]
    assert sizes == [4, 1, 1, 1, 1]  # one batch, then each item alone


async def test_unavailable_batch_is_not_retried() -> None:
    calls = 0

    async def dead(key: Hashable, items: Sequence[BatchItem[int]]) -> dict[int, int]:
        nonlocal calls
        calls += 1
        raise WorkerDied("worker 0 died")

    results, _ = await as_one_batch(dead, [0, 1, 2])
    assert all(isinstance(r, WorkerDied) for r in results)
    assert calls == 1


async def test_check_admission_refuses_before_any_work() -> None:
    model = FakeModel(gated=True)
    async with Streamer[object, Echo](
        model, max_batch_size=1, max_latency_s=10, max_queue_size=1
    ) as streamer:
        streamer.check_admission()
        blocker = asyncio.create_task(streamer.submit(0))
        await model.started.wait()
        queued = asyncio.create_task(streamer.submit(1))
        await soon(lambda: streamer.queue_depth == 1)
        with pytest.raises(QueueFull):
            streamer.check_admission()
        model.release.set()
        await asyncio.gather(blocker, queued)


@pytest.mark.parametrize("mode", ["missing", "extra", "not_a_mapping"])
async def test_batch_contract_violation_fails_the_whole_batch_loudly(mode: str) -> None:
    async def liar(key: Hashable, items: Sequence[BatchItem[int]]) -> object:
        if mode == "missing":
            return {i.id: i.payload for i in items[1:]}
        if mode == "extra":
            return {**{i.id: i.payload for i in items}, 10_000: 0}
        return [i.payload for i in items]

    results, _ = await as_one_batch(liar, [0, 1, 2])
    assert all(isinstance(r, BatchContractError) for r in results)


async def test_an_observer_that_fails_stops_neither_its_batch_nor_the_next() -> None:
    """The batch observer (the metrics) runs as a batch leaves the queue: one that raised
    left that batch's callers unanswered until their deadline, and the dispatcher dead for
    every request after them, while the server said it was ready."""
    calls = []

    def observer(*args: object) -> None:
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("a bug in the metrics")

    streamer: Streamer[object, Echo] = Streamer(
        FakeModel(), max_batch_size=1, max_latency_s=0, on_batch=observer
    )
    await streamer.start()
    try:
        async with asyncio.timeout(5):
            assert await streamer.submit(1) == ("default", 1)
            assert await streamer.submit(2) == ("default", 2)
    finally:
        await streamer.aclose()
    assert len(calls) == 2


async def test_submit_before_start_and_after_close_is_not_ready() -> None:
    streamer: Streamer[object, Echo] = Streamer(FakeModel(), max_batch_size=1, max_latency_s=0)
    with pytest.raises(NotReady):
        await streamer.submit(1)
    await streamer.start()
    await streamer.aclose()
    with pytest.raises(NotReady):
        await streamer.submit(1)


async def test_close_drains_admitted_work_then_answers_leftovers_not_ready() -> None:
    model = FakeModel(gated=True)
    streamer: Streamer[object, Echo] = Streamer(model, max_batch_size=2, max_latency_s=10)
    await streamer.start()
    blocker = asyncio.create_task(streamer.submit(0))
    await model.started.wait()
    queued = asyncio.create_task(streamer.submit(1))
    await soon(lambda: streamer.queue_depth == 1)
    asyncio.get_running_loop().call_later(0.05, model.release.set)
    await streamer.aclose(drain_timeout_s=5)
    assert await blocker == ("default", 0)
    assert await queued == ("default", 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_latency_s": -1}, "max_latency_s"),
        ({"max_queue_size": 0}, "max_queue_size"),
        ({"max_concurrent_batches": 0}, "max_concurrent_batches"),
    ],
)
def test_bad_construction_names_the_parameter(kwargs: dict[str, float], message: str) -> None:
    base = {"max_batch_size": 1, "max_latency_s": 0.0}
    with pytest.raises(ValueError, match=message):
        Streamer(FakeModel(), **{**base, **kwargs})  # type: ignore[arg-type]


async def test_each_item_reaches_the_transport_with_its_deadline() -> None:
    """A transport may forward the deadline (a broker does) or drop an expired item."""
    seen: list[tuple[object, float | None]] = []

    async def record(key: Hashable, items: Sequence[BatchItem[str]]) -> dict[int, str]:
        seen.extend((item.payload, item.deadline) for item in items)
        return {item.id: item.payload for item in items}

    now = [100.0]
    async with Streamer[str, str](
        record, max_batch_size=8, max_latency_s=0, clock=lambda: now[0]
    ) as s:
        await s.submit("bounded", timeout_s=2.5)
        await s.submit("unbounded")
    assert seen == [("bounded", 102.5), ("unbounded", None)]


async def test_a_batch_whose_callers_all_left_is_cancelled() -> None:
    """A transport may then stop the work (a broker drops what no worker has read)."""
    model = FakeModel(gated=True)
    cancelled = asyncio.Event()

    async def watched(key: Hashable, items: Sequence[BatchItem[object]]) -> dict[int, object]:
        try:
            return await model(key, items)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with Streamer[object, Echo](watched, max_batch_size=8, max_latency_s=10) as streamer:
        caller = asyncio.create_task(streamer.submit("left"))
        await model.started.wait()
        caller.cancel()
        await asyncio.wait_for(cancelled.wait(), 5)
        await soon(lambda: streamer.in_flight == 0)
        model.release.set()
        assert await streamer.submit("next") == ("default", "next")  # the slot is free again


async def test_a_batch_keeps_running_while_one_of_its_callers_waits() -> None:
    model = FakeModel(gated=True)
    async with Streamer[object, Echo](model, max_batch_size=8, max_latency_s=10) as streamer:
        blocker = asyncio.create_task(streamer.submit("blocker"))
        await model.started.wait()
        leaving, staying = (asyncio.create_task(streamer.submit(p)) for p in ("a", "b"))
        await soon(lambda: streamer.queue_depth == 2)
        model.release.set()
        await blocker
        leaving.cancel()
        assert await staying == ("default", "b")


async def test_answered_items_are_freed_without_waiting_for_the_garbage_collector() -> None:
    """No reference cycle holds an answered request's upload (or its result) in memory."""

    class Payload:
        pass

    async def ids(key: Hashable, items: Sequence[BatchItem[object]]) -> dict[int, object]:
        return {item.id: item.id for item in items}

    payloads = [Payload() for _ in range(16)]
    alive = [weakref.ref(payload) for payload in payloads]
    gc.disable()
    try:
        async with Streamer[object, int](ids, max_batch_size=8, max_latency_s=0.001) as streamer:
            await asyncio.gather(*(streamer.submit(payload) for payload in payloads))
            del payloads
            assert [ref for ref in alive if ref() is not None] == []
    finally:
        gc.enable()
