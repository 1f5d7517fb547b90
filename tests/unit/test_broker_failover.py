"""Broker mode behind Sentinel (issue #49), in parts: the URL every process parses
(``app.broker.wire.connect``), and what a front end does with the requests waiting when its
Redis goes away or another one answers (``app.broker.front.failover``), against a real
redis-server: a lost entry is sent again, a kept one waits, a late one is refused by type,
a reply already there is delivered, and a plain Redis fails them all at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis
from pydantic import ValidationError

from app.broker.front.failover import HOLD_S, Failover
from app.broker.front.waiting import Entry, LaneNote, Waiting
from app.broker.wire.control import decode_pins, restore_pins, set_pin
from app.broker.wire.keys import Keys
from app.broker.wire.lanes import Lane, encode_lane
from app.broker.wire.reply import encode_answer
from app.broker.wire.request import encode_request
from app.errors import BrokerUnavailable
from app.jobs import Task
from app.settings import Settings
from app.settings_values import BrokerAddress
from tests.broker import RedisServer


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_data_nodes_options() -> None:
    address = BrokerAddress.parse(
        "rediss+sentinel://front:pw@10.0.0.1:26380,10.0.0.2/mb/3"
        "?ssl_ca_certs=/ca.pem&ssl_certfile=/c.pem&ssl_keyfile=/c.key&sentinel_password=spw"
    )
    assert address.sentinel and address.service == "mb"
    assert address.sentinels == (("10.0.0.1", 26380), ("10.0.0.2", 26379))
    options = address.options
    assert (options["username"], options["password"], options["db"]) == ("front", "pw", 3)
    assert options["ssl"] is True and options["ssl_ca_certs"] == "/ca.pem"
    # The Sentinels: the same TLS files, their own password, never the data nodes'.
    assert address.sentinel_options["password"] == "spw"
    assert address.sentinel_options["ssl_certfile"] == "/c.pem"
    assert "pw" not in address.shown and "spw" not in address.shown
    assert address.shown == "rediss+sentinel://10.0.0.1:26380,10.0.0.2:26379/mb"


@pytest.mark.parametrize(
    "url", ["http://x", "redis+sentinel://h:1", "redis+sentinel:///mb", "redis+sentinel://h/a/1/2"]
)
def test_a_url_of_neither_kind_is_refused_at_start(url: str) -> None:
    with pytest.raises(ValidationError, match="URL"):
        Settings(mb_broker=url)


def test_the_settings_take_both_kinds() -> None:
    for url in ("redis://h:6379/0", "redis+sentinel://h:26379/mb", "unix:///run/redis.sock"):
        assert Settings(mb_broker=url).mb_broker is not None


def _request(request_id: str) -> dict[str, bytes]:
    return {"h": json.dumps({"id": request_id}).encode(), "img": b"x"}


async def _sent(client: aioredis.Redis, waiting: Waiting, rid: str, *, add: bool, left_s: float):  # type: ignore[no-untyped-def]
    """A waiting request; its entry added to Redis (``add``), or lost (an id Redis lacks)."""
    stream = "mb:{q}:v:tag"
    future = waiting.add(rid, "tiny@v")
    fields = _request(rid)
    entry_id: Any = await client.xadd(stream, fields) if add else b"1-1"  # type: ignore[arg-type]
    waiting.sent(rid, Entry(stream, entry_id, fields, time.monotonic() + left_s))
    return future


@contextlib.asynccontextmanager
async def _redis() -> AsyncIterator[aioredis.Redis]:
    """A client of a redis-server of its own."""
    with RedisServer() as server:
        client = aioredis.Redis.from_url(server.url)
        try:
            yield client
        finally:
            await client.aclose()


def _held() -> tuple[Waiting, list[str], Failover]:
    """What waits, the failover's events, and the failover (behind Sentinel: it holds)."""
    waiting, events = Waiting(), list[str]()
    return waiting, events, Failover(waiting, hold=True, on_event=events.append)


async def test_after_a_failover_each_waiting_request_gets_its_entry_back_or_a_typed_refusal() -> (
    None
):
    async with _redis() as client:
        waiting, events, failover = _held()
        kept = await _sent(client, waiting, "fe-kept", add=True, left_s=10)
        lost = await _sent(client, waiting, "fe-lost", add=False, left_s=10)
        late = await _sent(client, waiting, "fe-late", add=False, left_s=0.05)
        answered = await _sent(client, waiting, "fe-answered", add=False, left_s=10)
        # Its reply made it to the new primary (with its entry's deletion): delivered.
        reply = encode_answer("fe-answered", 1, np.ones(4, dtype=np.float32))
        await client.rpush("mb:replies:fe", reply)
        failover.lost(ConnectionError("primary gone"))
        assert len(waiting) == 4  # held, not failed
        failover.reached()
        await failover.recheck(client, "mb:replies:fe", waiting.deliver)
        assert events == ["reconnect", "resent", "lost"]
        assert not failover.recheck_due
        assert answered.done() and answered.result() is not None
        with pytest.raises(BrokerUnavailable, match="failed over and lost"):
            late.result()
        assert not kept.done() and not lost.done()
        resent = waiting.entry("fe-lost")
        assert resent is not None and resent.entry_id != b"1-1"
        found: Any = await client.xrange(resent.stream, resent.entry_id, resent.entry_id)
        assert found[0][1] == {k.encode(): v for k, v in _request("fe-lost").items()}
        assert await client.xlen(resent.stream) == 2  # the kept one and the resent one


async def test_an_entry_sent_again_for_a_caller_that_left_meanwhile_is_taken_back() -> None:
    """The caller leaves (its deadline, a disconnect) while its lost entry is sent again:
    the new entry leaves the stream, so no worker computes it for nobody."""

    class Leaving:
        """The client, where the caller leaves while the resend's script is under way."""

        def __init__(self, client: aioredis.Redis, waiting: Waiting) -> None:
            self.client, self.waiting = client, waiting

        def __getattr__(self, name: str) -> Any:
            return getattr(self.client, name)

        async def eval(self, *args: Any) -> Any:
            added = await self.client.eval(*args)
            self.waiting.discard("fe-left")  # as _reply does when its caller goes
            return added

    async with _redis() as client:
        waiting, events, failover = _held()
        await _sent(client, waiting, "fe-left", add=False, left_s=10)
        failover.lost(ConnectionError("primary gone"))
        failover.reached()
        await failover.recheck(Leaving(client, waiting), "mb:replies:fe", waiting.deliver)  # type: ignore[arg-type]
        assert await client.xlen("mb:{q}:v:tag") == 0
        assert events == ["reconnect"]


async def test_a_request_lost_with_its_lane_is_sent_again_with_the_lane_and_its_time_left() -> None:
    """A tenant's (or a priority level's) first request for a version made its lane: lost in
    the failover, the lane's description and doorbell went with it. Sent again, the workers
    learn of the lane again (before, the entry waited in a lane no worker read, and its
    caller got 503 at its deadline), and its deadline counts from the first sending."""
    keys = Keys("mb")
    lane = Lane(Task.TAG, level=1)
    stream = keys.lane("tiny@v", Task.TAG, 1, "acme")
    async with _redis() as client:
        waiting, events, failover = _held()
        waiting.add("fe-lane", "tiny@v")
        fields = encode_request("fe-lane", "fe", Task.TAG, 5, 9_000, b"img")
        note = LaneNote(keys.lanes("tiny@v"), keys.stream("tiny@v", Task.TAG), encode_lane(lane))
        waiting.sent("fe-lane", Entry(stream, b"1-1", fields, time.monotonic() + 2, note))
        failover.lost(ConnectionError("primary gone"))
        failover.reached()
        await failover.recheck(client, "mb:replies:fe", waiting.deliver)
        assert events == ["reconnect", "resent"]
        assert await client.hget(note.lanes, stream) == encode_lane(lane)
        doorbell: Any = await client.xrange(note.doorbell)
        assert [entry[1] for entry in doorbell] == [{b"lane": stream.encode()}]
        entries: Any = await client.xrange(stream)
        (resent,) = entries
        header = json.loads(resent[1][b"h"])
        assert 1_000 < header["ttl_ms"] <= 2_000, header


async def test_a_plain_redis_lost_fails_every_waiting_request_at_once() -> None:
    waiting = Waiting()
    future = waiting.add("fe-1", "tiny@v")
    Failover(waiting, hold=False).lost(ConnectionError("gone"))
    with pytest.raises(BrokerUnavailable, match="lost the broker"):
        future.result()
    restarted = Waiting()
    future = restarted.add("fe-2", "tiny@v")
    Failover(restarted, hold=False).restarted()
    with pytest.raises(BrokerUnavailable, match="restarted"):
        future.result()


async def test_a_request_failed_with_the_others_keeps_the_entry_it_was_sent_again_as() -> None:
    """A regression: failing every waiting request (Redis lost, held too long, restarted)
    dropped each one's entry record before its caller deleted its entry, so the caller
    deleted the first (lost) entry id, and the entry it was sent again as was computed for
    nobody, holding a place in the queue."""
    waiting = Waiting()
    future = waiting.add("fe-1", "tiny@v")
    again = Entry("mb:{q}:v:tag", b"2-0", {"h": b"{}", "img": b""}, None)
    waiting.sent("fe-1", again)
    Failover(waiting, hold=False).lost(ConnectionError("gone"))
    assert future.done() and "fe-1" not in waiting
    assert waiting.entry("fe-1") == again  # what its caller deletes
    waiting.discard("fe-1")  # its caller, done
    assert waiting.entry("fe-1") is None and len(waiting) == 0


async def test_behind_sentinel_requests_are_held_until_no_primary_came_back_in_time() -> None:
    waiting = Waiting()
    future = waiting.add("fe-1", "tiny@v")
    failover = Failover(waiting, hold=True)
    failover.lost(ConnectionError("gone"))
    assert not future.done() and failover.recheck_due
    assert failover.lost_since is not None
    failover.lost_since -= HOLD_S + 1  # as if no primary had answered since
    failover.lost(ConnectionError("still gone"))
    with pytest.raises(BrokerUnavailable, match="no primary came back"):
        future.result()
    await asyncio.sleep(0)


async def test_pins_a_failover_lost_are_written_again_past_the_number_they_had() -> None:
    keys = Keys("mb")
    async with _redis() as client:
        for _ in range(3):
            asked, raw = await set_pin(client, keys, "tiny", 2)
        await client.delete(keys.pins, keys.pins_seq)  # what a failover may lose
        await set_pin(client, keys, "other", 1)  # another front end's, after it
        seq, wrote = await restore_pins(client, keys, {"tiny": raw}, asked)
        assert seq >= asked and wrote == 1
        assert decode_pins(await client.hgetall(keys.pins)) == {"tiny": 2, "other": 1}
