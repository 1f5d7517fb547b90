"""The response cache on its own (``app.cache``): what its key covers, how its bytes are
bounded, single-flight, and that only successes are kept; its shared tier against a real
Redis, and without one."""

from __future__ import annotations

import asyncio
import itertools
import json
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from app.answers import BytesLRU, SharedAnswer, frozen, size_of
from app.broker.wire.reply import REPLY_MAGIC
from app.cache import CacheUse, Outcome, ResponseCache, cache_key
from app.cache.shared import COOL_OFF_S, SharedCache
from app.errors import DeadlineExceeded, InvalidImage, QueueFull, Shed
from app.jobs import EmbeddingAndTopK, Task, TopK
from tests.broker import RedisServer
from tests.server import free_port
from tests.waiting import wait_for

PIXELS = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)


def test_no_two_requests_that_differ_in_what_the_answer_depends_on_share_a_key() -> None:
    asked: list[tuple[str, Task, int, bytes | np.ndarray[Any, np.dtype[np.uint8]]]] = [
        ("m@1", Task.EMBEDDING, 0, b"jpeg"),
        ("m@1", Task.TAG, 5, b"jpeg"),
        ("m@1", Task.TAG, 3, b"jpeg"),
        ("m@1", Task.EMBEDDING_AND_TAG, 5, b"jpeg"),
        ("m@1", Task.EMBEDDING_AND_TAG, 3, b"jpeg"),
        ("m@2", Task.TAG, 5, b"jpeg"),  # another export
        ("m@1+bf16", Task.TAG, 5, b"jpeg"),  # another precision of it
        ("m@1", Task.TAG, 5, b"jpeg2"),
        ("m@1", Task.TAG, 5, PIXELS),
        ("m@1", Task.TAG, 5, PIXELS.reshape(3, 2, 3)),  # same bytes, another shape
        ("m@1", Task.TAG, 5, PIXELS.tobytes()),  # the same bytes as an upload
        ("m@1", Task.TAG, 51, b""),  # the fields run into each other: NUL keeps them apart
        ("m@1", Task.TAG, 5, b"1"),
    ]
    keys = [cache_key(*a) for a in asked]
    assert len(set(keys)) == len(keys)
    assert keys == [cache_key(*a) for a in asked]  # and each is the same every time
    assert cache_key("m@1", Task.TAG, 5, PIXELS[:, :, :]) == keys[8]


def test_the_memory_tier_stays_within_its_bytes_least_recently_used_first() -> None:
    one = np.zeros(256, np.float32)
    evicted: list[int] = []
    lru = BytesLRU(3 * size_of(one), on_evict=lambda: evicted.append(1))
    for key in (b"a", b"b", b"c"):
        lru.put(key, frozen(one))
    assert lru.get(b"a") is not None  # a is now the most recent: b goes first
    lru.put(b"d", frozen(one))
    assert [k for k in (b"a", b"b", b"c", b"d") if lru.get(k) is not None] == [b"a", b"c", b"d"]
    assert lru.bytes == 3 * size_of(one) <= lru.max_bytes and len(evicted) == lru.evictions == 1
    lru.put(b"huge", frozen(np.zeros(4096, np.float32)))  # more than all of it: not kept
    assert lru.get(b"huge") is None and len(lru) == 3
    lru.put(b"a", frozen(one))  # kept again under the same key: counted once
    assert lru.bytes == 3 * size_of(one)


def test_a_kept_answer_is_a_read_only_copy_not_a_view_of_its_batch() -> None:
    batch = np.arange(12, dtype=np.float32).reshape(3, 4)
    kept = frozen(EmbeddingAndTopK(batch[1], TopK(np.arange(3), batch[2, :3])))
    assert isinstance(kept, EmbeddingAndTopK)
    batch[:] = -1  # the buffer is reused for the next batch
    assert kept.embedding.tolist() == [4, 5, 6, 7] and kept.top_k.probs.tolist() == [8, 9, 10]
    assert not kept.embedding.flags.writeable and kept.embedding.base is None
    with pytest.raises(TypeError):
        frozen(InvalidImage("not an answer"))


def counting(
    answer: object = None, error: BaseException | None = None, gate: asyncio.Event | None = None
) -> tuple[list[int], Callable[[], Awaitable[object]]]:
    """A computation that counts its calls, waits for ``gate``, then answers or fails."""
    calls: list[int] = []

    async def compute() -> object:
        calls.append(1)
        if gate is not None:
            await gate.wait()
        if error is not None:
            raise error
        return np.full(4, len(calls), np.float32) if answer is None else answer

    return calls, compute


async def test_a_hit_is_the_miss_that_filled_it_and_no_cache_computes_afresh() -> None:
    seen: list[Outcome] = []
    cache = ResponseCache(1 << 20, on_outcome=seen.append)
    calls, compute = counting()
    first, second = CacheUse(), CacheUse()
    miss = await cache.answer(b"k", compute, first)
    hit = await cache.answer(b"k", compute, second)
    assert calls == [1] and hit is miss and first.header == "miss" and second.header == "hit"
    fresh = CacheUse.asked("no-cache")
    renewed = await cache.answer(b"k", compute, fresh)
    assert calls == [1, 1] and fresh.header == "miss" and np.asarray(renewed)[0] == 2
    assert await cache.answer(b"k", compute, None) is renewed  # the fresh answer is kept
    assert seen == [Outcome.MISS, Outcome.HIT, Outcome.FRESH, Outcome.HIT]


async def test_an_answer_a_worker_shared_is_told_coalesced_and_kept_as_the_answer() -> None:
    seen: list[Outcome] = []
    cache = ResponseCache(1 << 20, on_outcome=seen.append)
    vector = np.arange(4, dtype=np.float32)
    calls, compute = counting(answer=SharedAnswer(vector))
    use = CacheUse()
    got = await cache.answer(b"k", compute, use)
    assert use.header == "coalesced" and seen == [Outcome.COALESCED] and calls == [1]
    assert isinstance(got, np.ndarray) and got.tobytes() == vector.tobytes()
    assert await cache.answer(b"k", compute, again := CacheUse()) is got  # kept, unwrapped
    assert again.header == "hit" and calls == [1]


async def test_thirty_two_identical_requests_in_flight_are_computed_once() -> None:
    cache = ResponseCache(1 << 20)
    gate = asyncio.Event()
    calls, compute = counting(gate=gate)
    uses = [CacheUse() for _ in range(32)]
    waiting = [asyncio.ensure_future(cache.answer(b"k", compute, use)) for use in uses]
    await asyncio.sleep(0.01)
    assert cache.in_flight == 1
    gate.set()
    answers = await asyncio.gather(*waiting)
    assert calls == [1] and all(answer is answers[0] for answer in answers)
    assert sorted(use.header or "" for use in uses) == ["coalesced"] * 31 + ["miss"]
    assert cache.in_flight == 0


async def test_errors_are_never_kept_and_a_client_error_is_shared_with_those_waiting() -> None:
    cache = ResponseCache(1 << 20)
    gate = asyncio.Event()
    calls, compute = counting(error=InvalidImage("not an image"), gate=gate)
    waiting = [asyncio.ensure_future(cache.answer(b"k", compute, CacheUse())) for _ in range(3)]
    await asyncio.sleep(0.01)
    gate.set()
    failed = await asyncio.gather(*waiting, return_exceptions=True)
    assert calls == [1] and all(isinstance(error, InvalidImage) for error in failed)
    assert len({id(error) for error in failed}) == 3  # each its own instance
    with pytest.raises(InvalidImage):
        await cache.answer(b"k", compute, CacheUse())
    assert calls == [1, 1]  # computed again: nothing was kept


async def test_a_request_waits_on_an_identical_one_until_its_own_deadline_only() -> None:
    """A follower's deadline is its own, as it would be queued: 504 when it passes, while
    the computation goes on for the others; one with a later deadline still gets it."""
    cache = ResponseCache(1 << 20)
    gate = asyncio.Event()
    calls, compute = counting(gate=gate)
    leader = asyncio.ensure_future(cache.answer(b"k", compute, CacheUse()))
    await asyncio.sleep(0.01)
    began = time.monotonic()
    hurried = asyncio.ensure_future(cache.answer(b"k", compute, CacheUse(), deadline=began + 0.1))
    patient = asyncio.ensure_future(cache.answer(b"k", compute, CacheUse(), deadline=began + 30))
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(hurried, 5)
    assert 0.09 < time.monotonic() - began < 2
    assert not leader.done() and not patient.done()
    gate.set()
    assert await leader is await patient
    assert calls == [1]


@pytest.mark.parametrize(
    ("first", "other"),
    [
        # Priority 1 beside an identical priority 2 in flight (which may wait long in the
        # queue).
        ({"level": 1}, {"level": 0}),
        # A regression: a quiet tenant's request waited on a noisy tenant's identical one,
        # queued behind that tenant's share of every batch.
        ({"tenant": "bulk"}, {"tenant": "shop"}),
    ],
    ids=["more urgent", "another tenant"],
)
async def test_a_request_does_not_wait_on_one_that_queues_worse_than_it_would(
    first: dict[str, Any], other: dict[str, Any]
) -> None:
    """It computes alone, at once; one that would queue where the flight does (as urgent,
    the same tenant) waits on it."""
    cache = ResponseCache(1 << 20)
    gate = asyncio.Event()
    first_calls, slow = counting(gate=gate)
    leader = asyncio.ensure_future(cache.answer(b"k", slow, CacheUse(), **first))
    await asyncio.sleep(0.01)
    same_calls, same = counting()
    alike = asyncio.ensure_future(cache.answer(b"k", same, CacheUse(), **first))
    other_calls, computed = counting()
    use = CacheUse()
    await asyncio.wait_for(cache.answer(b"k", computed, use, **other), 5)
    assert other_calls == [1] and use.header == "miss"
    assert not leader.done() and not alike.done()
    gate.set()
    assert await leader is await alike
    assert first_calls == [1] and same_calls == []


async def test_no_request_waits_on_one_past_its_level_s_queue_timeout() -> None:
    """A regression: under ``on_timeout: delay`` the first request, past its level's queue
    timeout, waits behind everything else, and those waiting on it waited there too. They
    wait on it for its level's time at most, then compute (one for all of them); later
    ones no longer join it."""
    cache = ResponseCache(1 << 20)
    gate = asyncio.Event()
    delayed_calls, delayed = counting(gate=gate)
    leader = asyncio.ensure_future(cache.answer(b"k", delayed, CacheUse(), patience_s=0.2))
    await asyncio.sleep(0.01)
    calls, compute = counting()
    began = time.monotonic()
    uses = [CacheUse() for _ in range(3)]
    waiting = [asyncio.ensure_future(cache.answer(b"k", compute, use)) for use in uses]
    answers = await asyncio.wait_for(asyncio.gather(*waiting), 5)
    assert 0.15 < time.monotonic() - began < 2
    assert calls == [1] and all(answer is answers[0] for answer in answers)
    headers = sorted(use.header or "" for use in uses)  # the others waited on it, or hit
    assert headers[-1] == "miss" and set(headers[:-1]) <= {"coalesced", "hit"}
    assert not leader.done()
    gate.set()
    await leader
    assert delayed_calls == [1]


@pytest.mark.parametrize("how", ["timeout", "overload", "shed", "cancel"])
async def test_when_the_computation_comes_to_nothing_each_waiting_request_tries_itself(
    how: str,
) -> None:
    """The first request timed out (its deadline, not the others'), was refused (the
    server full, or its own priority shed: a 429 that is its, not the image's), or its
    client left: those that waited on it compute their own answer (one of them for all)."""
    cache = ResponseCache(1 << 20)
    gate = asyncio.Event()
    first_calls, first = counting(
        error={
            "timeout": DeadlineExceeded("late"),
            "overload": QueueFull("full"),
            "shed": Shed("priority 2 gives way", retry_after_s=1),
        }.get(how),
        gate=gate,
    )
    leader = asyncio.ensure_future(cache.answer(b"k", first, CacheUse()))
    await asyncio.sleep(0.01)
    calls, compute = counting()
    followers = [asyncio.ensure_future(cache.answer(b"k", compute, CacheUse())) for _ in range(4)]
    await asyncio.sleep(0.01)
    if how == "cancel":
        leader.cancel()
    gate.set()
    outcome = await asyncio.gather(leader, return_exceptions=True)
    assert isinstance(outcome[0], BaseException)
    answers = await asyncio.gather(*followers)
    assert calls == [1] and all(answer is answers[0] for answer in answers)
    assert first_calls == [1]


async def test_only_answers_the_key_names_are_handed_out() -> None:
    """An answer is never another key's, even for keys that arrive together."""
    cache = ResponseCache(1 << 20)
    keys = [bytes([n]) for n in range(8)]

    async def one(key: bytes) -> None:
        async def compute() -> object:
            await asyncio.sleep(0.001 * (key[0] % 3))
            return np.full(2, key[0], np.float32)

        for _ in range(3):
            answer = await cache.answer(key, compute, CacheUse())
            assert np.asarray(answer)[0] == key[0]

    await asyncio.gather(*(one(key) for key in itertools.chain(keys, keys, keys)))


@pytest.fixture
def redis_url() -> str:  # type: ignore[misc]
    with RedisServer() as server:
        yield server.url


async def test_the_shared_tier_hands_one_front_end_s_answer_to_another_bit_for_bit(
    redis_url: str,
) -> None:
    errors: list[int] = []
    front_ends = [
        ResponseCache(1 << 20, SharedCache.connect(redis_url, "t", 60, lambda: errors.append(1)))
        for _ in range(2)
    ]
    try:
        answer = EmbeddingAndTopK(
            np.random.default_rng(0).random(16, dtype=np.float32),
            TopK(np.array([3, 1]), np.array([0.7, 0.2], np.float32)),
        )
        calls, compute = counting(answer=answer)
        first, second = CacheUse(), CacheUse()
        await front_ends[0].answer(b"k", compute, first)
        await cached_in_redis(redis_url, 1)  # the write is in the background
        got = await front_ends[1].answer(b"k", compute, second)
        assert calls == [1] and first.outcomes == [Outcome.MISS]
        assert second.outcomes == [Outcome.SHARED_HIT] and second.header == "hit"
        assert isinstance(got, EmbeddingAndTopK)
        assert got.embedding.tobytes() == answer.embedding.tobytes()
        assert got.top_k.indices.tolist() == [3, 1]
        assert got.top_k.probs.tobytes() == answer.top_k.probs.tobytes()
        assert await front_ends[1].answer(b"k", compute, third := CacheUse()) is got
        assert third.outcomes == [Outcome.HIT]  # now in that front end's own memory
        assert errors == []
    finally:
        for cache in front_ends:
            await cache.aclose()


@pytest.mark.parametrize(
    "forged",
    [
        {"id": "cache", "batch": 1, "arrays": [[["x"], "<f4", [0]]]},  # a list as a name
        {"id": "cache", "batch": 1, "error": [["x"], "m"]},
        None,
    ],
)
async def test_a_shared_entry_that_is_not_an_answer_is_a_miss(
    redis_url: str, forged: dict[str, Any] | None
) -> None:
    """However a forged entry fails to parse (before: a list where a name goes raised
    TypeError, a 500), it is a miss."""
    raw = b"forged"
    if forged is not None:
        header = json.dumps(forged).encode()
        raw = REPLY_MAGIC + struct.pack(">I", len(header)) + header
    shared = SharedCache.connect(redis_url, "t", 60, lambda: None)
    try:
        await shared._client.set(shared._name(b"k"), raw)
        assert await shared.get(b"k") is None
    finally:
        await shared.aclose()


async def test_without_its_redis_the_cache_serves_on_each_request_waiting_little() -> None:
    errors: list[int] = []
    dead = f"redis://127.0.0.1:{free_port()}/0"
    cache = ResponseCache(0, SharedCache.connect(dead, "t", 60, lambda: errors.append(1)))
    try:
        calls, compute = counting()
        started = time.perf_counter()
        for _ in range(5):
            await cache.answer(b"k", compute, CacheUse())
        took = time.perf_counter() - started
        assert calls == [1] * 5  # no memory tier, no Redis: each computed, none failed
        assert errors and len(errors) <= 2  # then it leaves Redis alone for COOL_OFF_S
        assert took < COOL_OFF_S
    finally:
        await cache.aclose()


async def cached_in_redis(redis_url: str, count: int) -> None:
    """Wait until Redis holds ``count`` cached answers (written in the background)."""
    import redis

    admin = redis.Redis.from_url(redis_url)
    try:
        await wait_for(lambda: len(admin.keys("t:cache:*")) >= count, timeout_s=5,
                       what=f"{count} answers in Redis")  # fmt: skip
    finally:
        admin.close()


def _command_calls(client: Any, *names: str) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in names}


async def test_the_shared_tier_batches_its_round_trips_on_two_connections(redis_url: str) -> None:
    import redis

    errors: list[int] = []
    shared = SharedCache.connect(redis_url, "t", 60, lambda: errors.append(1))
    admin = redis.Redis.from_url(redis_url)
    keys = [bytes([i]) * 32 for i in range(64)]
    answers = [np.full(8, i, np.float32) for i in range(64)]
    try:
        admin.config_resetstat()
        for key, answer in zip(keys, answers, strict=True):  # a batch of answers comes back
            shared.put(key, answer)
        await cached_in_redis(redis_url, len(keys))
        got = await asyncio.gather(*(shared.get(key) for key in [*keys, b"none"]))
        assert got[-1] is None
        for answer, kept in zip(answers, got[:-1], strict=True):
            assert np.asarray(kept).tobytes() == answer.tobytes()
        calls = _command_calls(admin, "set", "get", "mget")
        # 64 writes in one pipeline, 65 reads in one MGET (or two: the first goes alone while
        # the rest gather), not 129 round trips on as many connections.
        assert calls["set"] == 64 and calls["get"] == 0 and 1 <= calls["mget"] <= 2
        own = admin.client_id()
        theirs = [c for c in admin.client_list() if int(c["id"]) != own]
        assert len(theirs) <= 2, theirs  # one connection for reads, one for writes
        assert errors == []
    finally:
        admin.close()
        await shared.aclose()


async def test_a_slow_shared_tier_costs_each_request_its_timeout_and_is_counted_once(
    redis_url: str,
) -> None:
    import redis

    errors: list[int] = []
    shared = SharedCache.connect(redis_url, "t", 60, lambda: errors.append(1))
    admin = redis.Redis.from_url(redis_url)
    try:
        assert await shared.get(b"warm") is None and errors == []
        admin.client_pause(2000)  # Redis answers nobody
        started = time.perf_counter()
        got = await asyncio.gather(*(shared.get(bytes([i])) for i in range(16)))
        took = time.perf_counter() - started
        assert got == [None] * 16 and took < 0.5  # each waits its 50 ms, not Redis's 2 s
        # Their MGET's own bound ends as theirs do.
        await wait_for(lambda: errors, timeout_s=0.5, what="the failure counted")
        assert errors == [1]  # one failure, then the tier rests
        assert await shared.get(b"again") is None and errors == [1]  # resting: not asked
    finally:
        admin.client_unpause()
        admin.close()
        await shared.aclose()


async def test_closing_the_shared_tier_answers_every_lookup_waiting_as_a_miss(
    redis_url: str,
) -> None:
    import redis

    shared = SharedCache.connect(redis_url, "t", 60, lambda: None, timeout_s=1.0)
    admin = redis.Redis.from_url(redis_url)
    try:
        assert await shared.get(b"warm") is None
        admin.client_pause(2000)  # the lookups below wait on Redis when the close comes
        lookups = [asyncio.ensure_future(shared.get(bytes([i]))) for i in range(8)]
        await asyncio.sleep(0.01)  # their MGET is sent
        started = time.perf_counter()
        await shared.aclose()
        assert await asyncio.gather(*lookups) == [None] * 8
        assert time.perf_counter() - started < 0.5  # at once, not after their 1 s
        assert await shared.get(b"after") is None  # closed: a miss, Redis not asked
        shared.put(b"after", np.zeros(2, np.float32))  # nor written
    finally:
        admin.client_unpause()
        admin.close()
