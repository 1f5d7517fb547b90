"""The admin route's pins across a Redis failover or restart, on real redis-servers: a
primary and its replica, the replica promoted, and a write to the old primary after that as
a write it answered and never passed on (asynchronous replication). Front ends write back
what another Redis lacks (``app.broker.front.pins``), each name taking its latest write,
whoever made it; found by a review: a cleared pin was never written back, and a front end
wrote its own old pins over newer ones of others, so the fleet served what nobody asked for
while the admin call waited out its deadline."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import pytest
import redis.asyncio as aioredis

from app.broker.front.monitor import Monitor
from app.broker.wire.control import decode_pins
from app.broker.wire.keys import Keys
from app.lifecycle import AdminPin
from tests.broker import RedisServer

KEYS = Keys("mb")


@contextmanager
def primary_and_replica() -> Iterator[tuple[RedisServer, RedisServer]]:
    with RedisServer() as primary, RedisServer() as replica:
        primary.client().config_set("repl-diskless-sync-delay", 0)
        replica.client().replicaof("127.0.0.1", primary.port)
        primary.client().set("mb:probe", 1)
        assert primary.client().wait(1, 5000) == 1, "the replica never caught up"
        yield primary, replica


def promote(primary: RedisServer, replica: RedisServer) -> None:
    """The replica becomes the primary, with every write the primary passed on so far; what
    the primary answers from now on is lost."""
    assert primary.client().wait(1, 5000) == 1
    replica.client().replicaof("NO", "ONE")


OPENED: list[aioredis.Redis] = []  # every front end's clients, closed after each test


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    while OPENED:
        await OPENED.pop().aclose()


async def front_end(server: RedisServer) -> Monitor:
    monitor = Monitor(KEYS)
    follow(monitor, server)
    await monitor.look()
    return monitor


def follow(monitor: Monitor, server: RedisServer) -> None:
    monitor.client = aioredis.Redis(port=server.port)
    monitor.clients = [monitor.client]
    OPENED.append(monitor.client)


async def pins_on(server: RedisServer) -> tuple[dict[str, AdminPin], int]:
    client = server.client()
    return decode_pins(client.hgetall(KEYS.pins)), int(client.hget(KEYS.pins_seq, "seq") or 0)


async def test_a_cleared_pin_the_failover_lost_is_cleared_again() -> None:
    with primary_and_replica() as (primary, replica):
        front = await front_end(primary)
        await front.pin("tagger", 2)
        promote(primary, replica)
        asked = await front.pin("tagger", None)  # a load of the newest: the pin cleared, lost
        follow(front, replica)
        await front.look()
        pins, seq = await pins_on(replica)
        assert pins == {} and seq >= asked
        assert front.pins == {}


async def test_a_restart_that_lost_every_pin_gets_the_fleet_s_last_pins_in_any_order() -> None:
    with RedisServer() as server:
        for order in itertools.permutations(range(3)):
            server.client().flushall()
            fronts = [await front_end(server) for _ in range(3)]
            await fronts[0].pin("tagger", 2)
            await fronts[1].pin("tagger", 3)  # later: the fleet's
            await fronts[2].pin("embedder", 4)
            for front in fronts:
                await front.look()
            server.stop()
            server.start()  # empty, another run id
            for index in order:
                follow(fronts[index], server)
                await fronts[index].look()
            pins, _ = await pins_on(server)
            assert pins == {"tagger": 3, "embedder": 4}, order


async def test_a_pin_written_on_the_new_primary_is_never_undone_by_a_restore() -> None:
    with primary_and_replica() as (primary, replica):
        first, second = await front_end(primary), await front_end(primary)
        await first.pin("tagger", 2)
        await second.look()
        promote(primary, replica)
        await first.pin("embedder", 5)  # lost
        follow(second, replica)
        await second.look()
        await second.pin("tagger", 3)  # on the new primary, before the first looks
        follow(first, replica)
        await first.look()
        pins, _ = await pins_on(replica)
        assert pins == {"tagger": 3, "embedder": 5}


async def test_a_write_the_old_primary_answered_late_is_written_again() -> None:
    with primary_and_replica() as (primary, replica):
        front = await front_end(primary)
        await front.pin("tagger", 2)
        promote(primary, replica)
        old = front.client
        follow(front, replica)
        await front.look()  # another Redis answers: restored (nothing lost yet)
        front.admin = old  # a call on a connection to the old primary, answered now
        asked = await front.pin("tagger", 3)
        front.admin = None
        await front.look()
        pins, seq = await pins_on(replica)
        assert pins == {"tagger": 3} and seq >= asked


async def test_a_reload_the_failover_lost_is_asked_again() -> None:
    with primary_and_replica() as (primary, replica):
        front = await front_end(primary)
        promote(primary, replica)
        asked = await front.reload(explicit=True)  # kill -HUP of a front end, lost
        follow(front, replica)
        await front.look()
        _, seq = await pins_on(replica)
        assert seq >= asked
