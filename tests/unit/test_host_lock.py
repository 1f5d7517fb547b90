"""A host's load slot (``HostLock``), on a real Redis: one worker of a host loads at a time,
and a slot its holder no longer uses never blocks the others' loads, even when its release
was lost (the full suite found a rollout stuck for the load deadline: a worker's release
failed while Redis failed over, and the other worker of its host waited for the slot's
expiry before it loaded the new version)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError

from app.broker.wire.keys import STALE_S, Keys
from app.broker.worker.loading import HostLock
from tests.broker import RedisServer

KEYS = Keys("mb")
TIMEOUT_S = 300.0
BOTH = ("w1", "w2")


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    with RedisServer() as server:
        yield server.client()


def locks(client: redis.Redis) -> tuple[HostLock, HostLock]:
    """The slot of two workers of one host."""
    first, second = (HostLock(client, KEYS, "host-a", TIMEOUT_S, owner=name) for name in BOTH)
    return first, second


def aged(client: redis.Redis, seconds: float) -> None:
    """The host's slot as if taken ``seconds`` ago."""
    (key,) = client.keys(f"{KEYS.loading('host-a')}:*")
    client.pexpire(key, int(1000 * (TIMEOUT_S - seconds)))


def test_one_worker_of_a_host_loads_at_a_time(client: redis.Redis) -> None:
    first, second = locks(client)
    assert first.take(BOTH)
    assert not second.take(BOTH), "the slot is held by a live worker that loads"
    first.release()
    assert second.take(BOTH)


def test_a_release_redis_could_not_take_is_asked_again_at_the_next_round(
    client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = locks(client)
    assert first.take(BOTH)
    real = first._release

    def unreachable(**kwargs: Any) -> Any:
        raise RedisConnectionError("Redis is failing over")

    monkeypatch.setattr(first, "_release", unreachable)
    first.release()  # logged, not raised
    assert not second.take(BOTH, idle=["w1"]), "a fresh slot is never taken over"
    monkeypatch.setattr(first, "_release", real)
    first.settle()  # the next round
    assert second.take(BOTH)


def test_a_slot_whose_release_was_lost_is_taken_over_once_its_holder_says_it_loads_nothing(
    client: redis.Redis,
) -> None:
    first, second = locks(client)
    assert first.take(BOTH)
    aged(client, STALE_S + 1)  # its release never reached the primary of now
    assert not second.take(BOTH), "its heartbeat says it loads"
    assert second.take(BOTH, idle=["w1"])
    assert not first.take(BOTH, idle=["w2"]), "the new holder's slot is fresh"


def test_a_slot_of_a_worker_no_longer_live_or_of_its_last_life_is_taken_over(
    client: redis.Redis,
) -> None:
    first, second = locks(client)
    assert first.take(BOTH)
    assert not second.take(["w2"]), "w1 took it since its last heartbeat (a Redis outage)"
    aged(client, STALE_S + 1)
    assert second.take(["w2"]), "w1 is no longer live"
    restarted = HostLock(client, KEYS, "host-a", TIMEOUT_S, owner="w2")
    assert restarted.take(BOTH), "its last life died loading"
