"""A broker worker's claims on its own pending entries, on a real Redis: at its start it
takes back its last life's, never the entries its fetcher read in this life (a race the
full suite found: the first request of a fresh worker was run twice, once from the
read-ahead slot and once claimed back); after a Redis failover, every one of them. And its
answers (``Replier``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import redis

from app.broker.wire.keys import GROUP, Keys
from app.broker.wire.request import Request
from app.broker.worker.health import TroubleLog
from app.broker.worker.orphans import OrphanClaims
from app.broker.worker.replies import Entry, Replier
from app.broker.worker.stats import ConsumerStats
from app.jobs import Task
from tests.broker import RedisServer

KEYS = Keys("mb")
STREAM = "mb:{q}:89e9be0d4f64:tag"


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    with RedisServer() as server:
        yield server.client()


def claims(client: redis.Redis, ran: list[bytes], max_deliveries: int = 3) -> OrphanClaims:
    def process(stream: str, entries: Sequence[Entry], delivery: int) -> None:
        for entry_id, fields in entries:  # run and answered: acknowledged
            ran.append(fields[b"n"])
            client.xack(stream, GROUP, entry_id)

    stats, stop = ConsumerStats(), threading.Event()
    trouble = TroubleLog("w1", stats)
    return OrphanClaims(
        client, KEYS, "w1", stats, Replier(client, KEYS, stop, trouble), process,
        lambda: [STREAM], trouble,
        max_image_bytes=1 << 20, max_deliveries=max_deliveries, batch_timeout_s=60, stop=stop,
    )  # fmt: skip


def read_as_w1(client: redis.Redis, name: bytes) -> None:
    client.xadd(STREAM, {"n": name})
    client.xreadgroup(GROUP, "w1", {STREAM: ">"}, count=1)


def test_a_worker_takes_back_its_last_life_s_entries_not_this_life_s(client: redis.Redis) -> None:
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    read_as_w1(client, b"last life")
    time.sleep(0.05)
    ran: list[bytes] = []
    own = claims(client, ran)  # this life begins (its loads take a while)
    time.sleep(0.05)
    read_as_w1(client, b"read ahead")  # its fetcher's, being computed
    time.sleep(0.02)
    own.recover(own=True)
    assert ran == [b"last life"]
    own.retake_own()  # after a failover: this life's too
    own.recover(own=True)
    assert ran == [b"last life", b"read ahead"]


def test_after_a_lost_read_a_worker_takes_back_what_came_before_its_next_read(
    client: redis.Redis,
) -> None:
    """A read whose answer was lost (a socket timeout in a Redis stall) made an entry the
    worker's in Redis that it never saw: once a read goes through, the entries delivered
    before that read are taken back, not what that read took (being computed)."""
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    ran: list[bytes] = []
    own = claims(client, ran)
    own.recover(own=True)  # its start: nothing of a last life
    read_as_w1(client, b"lost")  # delivered; its answer never reached the worker
    own.recover(own=True)
    assert ran == []  # asked once only: nothing to take back without a lost read
    time.sleep(0.05)
    cut = time.monotonic()
    time.sleep(0.05)
    read_as_w1(client, b"next read")  # went through: the main loop computes it
    own.retake_own(delivered_before=cut)
    own.recover(own=True)
    assert ran == [b"lost"]
    own.recover(own=True)
    assert ran == [b"lost"]  # once per ask


def test_a_take_back_that_could_not_reach_redis_is_asked_again(client: redis.Redis) -> None:
    """Redis away at the round that should take its entries back: the next round does."""
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    read_as_w1(client, b"last life")
    time.sleep(0.05)
    ran: list[bytes] = []
    own = claims(client, ran)
    real = client.xpending_range
    failures = [redis.exceptions.ConnectionError("Redis is away")]

    def away_once(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return real(*args, **kwargs)

    client.xpending_range = away_once  # type: ignore[method-assign]
    own.recover(own=True)
    assert ran == []
    own.recover(own=True)
    assert ran == [b"last life"]


@pytest.mark.parametrize("ask", ["lost read", "failover"])
def test_taking_its_own_back_after_a_lost_read_or_a_failover_is_not_a_failed_delivery(
    client: redis.Redis, ask: str
) -> None:
    """A regression: every claim counted as a delivery toward MB_MAX_DELIVERIES, so with 1
    an entry taken back after a lost read or a failover was answered 500 ("the model failed
    on this image 1 times") unrun. Its count stays as it was; its last life's still count."""
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    ran: list[bytes] = []
    own = claims(client, ran, max_deliveries=1)
    own.recover(own=True)  # its start: nothing of a last life
    read_as_w1(client, b"lost")
    time.sleep(0.05)
    own.retake_own(delivered_before=time.monotonic() if ask == "lost read" else None)
    own.recover(own=True)
    assert ran == [b"lost"]
    assert own.stats.given_up == 0


def test_its_last_life_s_entries_count_even_with_a_failover_before_it_took_them_back(
    client: redis.Redis,
) -> None:
    """Its last life may have died of one of them (a poison image): a failover or a lost
    read asked before its first take-back does not make them uncounted."""
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    client.xadd(STREAM, {"h": b"{}", "img": b""})
    client.xreadgroup(GROUP, "w1", {STREAM: ">"}, count=1)  # its last life, which died
    time.sleep(0.05)
    ran: list[bytes] = []
    own = claims(client, ran, max_deliveries=1)
    own.retake_own()  # a failover, before its first round
    own.recover(own=True)
    assert ran == [] and own.stats.given_up == 1  # delivered a second time: given up


def test_a_reply_list_that_is_not_a_list_fails_its_reply_alone_and_holds_nothing(
    client: redis.Redis,
) -> None:
    """A regression: a front end's reply key holding another type (WRONGTYPE) failed the
    whole answer, which the worker then tried again every 0.5 s for ever, pushing the
    other front ends' replies again each time, its batches stalled."""
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    ids = [client.xadd(STREAM, {"n": str(n)}) for n in range(2)]
    client.xreadgroup(GROUP, "w1", {STREAM: ">"})
    client.set(KEYS.replies("forged"), "a string")
    stats, stop = ConsumerStats(), threading.Event()
    replier = Replier(client, KEYS, stop, TroubleLog("w1", stats))
    asked = [Request(str(n), fe, Task.TAG, 1, 1000, b"") for n, fe in enumerate(("fe", "forged"))]
    finished = threading.Event()

    def answer() -> None:
        replier.answer(STREAM, [(i, r, b"reply") for i, r in zip(ids, asked, strict=True)], [])
        finished.set()

    threading.Thread(target=answer, daemon=True).start()
    assert finished.wait(5), "the worker is held retrying"
    stop.set()
    assert client.lrange(KEYS.replies("fe"), 0, -1) == [b"reply"]  # once
    assert client.xlen(STREAM) == 0 and client.xpending(STREAM, GROUP)["pending"] == 0
