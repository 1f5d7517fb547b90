"""A broker worker's reading of Redis's clock (``RedisClock``), by which it judges every
entry's deadline: a heartbeat whose answer came back late (the worker paused, throttled, or
descheduled on a busy host) does not move it. Before, each heartbeat set the clock to the
middle of its round trip, so a worker resumed from a pause judged entries younger by half
the pause and ran requests past their deadline (``test_broker.py``'s deadline test, a
flake of the full suite)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis

from app.broker.wire.keys import Keys
from app.broker.worker.health import Heartbeat, RedisClock
from tests.broker import RedisServer
from tests.proxy import StallingProxy

TRUE_OFFSET_MS = 123_456.0


def heard(clock: RedisClock, answered_s: float, before_s: float, after_s: float) -> None:
    """Redis answered at ``answered_s`` (this host's clock) a call made and read then."""
    clock.heard(int(1000 * answered_s + TRUE_OFFSET_MS), before_s=before_s, after_s=after_s)


def error_ms(clock: RedisClock, at_s: float) -> float:
    return clock.now_ms(at_s) - (1000 * at_s + TRUE_OFFSET_MS)


def test_a_late_answer_does_not_move_the_clock_a_fast_one_set() -> None:
    clock = RedisClock()  # a heartbeat a second
    heard(clock, 10.0005, 10.0, 10.001)
    heard(clock, 11.0, 11.0, 11.5)  # answered at once, read after a pause of 0.5 s
    assert abs(error_ms(clock, 11.5)) <= 2
    heard(clock, 12.0, 12.0, 15.0)  # 3 s
    assert abs(error_ms(clock, 15.0)) <= 3
    heard(clock, 16.9, 16.0, 17.0)  # sent, then paused: answered just before the read
    assert abs(error_ms(clock, 17.0)) <= 4
    heard(clock, 18.0002, 18.0, 18.0004)
    assert abs(error_ms(clock, 18.0004)) <= 1


def test_each_fast_answer_narrows_it_and_a_clock_that_jumped_starts_it_afresh() -> None:
    clock = RedisClock()
    heard(clock, 1.3, 1.0, 2.0)  # only one slow reading: within half its round trip
    assert abs(error_ms(clock, 2.0)) <= 501
    heard(clock, 3.0002, 3.0, 3.0004)
    assert abs(error_ms(clock, 4.0)) <= 1.5
    clock.heard(int(1000 * 5.0 + TRUE_OFFSET_MS + 60_000), before_s=5.0, after_s=5.001)
    assert abs(error_ms(clock, 6.0) - 60_000) <= 1.5, "another Redis, a minute ahead"


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def test_a_heartbeat_answered_late_through_a_stalled_path_keeps_redis_s_time(
    redis_server: RedisServer,
) -> None:
    proxy = StallingProxy(redis_server.port)
    try:
        client = redis.Redis(port=proxy.port)
        heartbeat = Heartbeat(client, Keys("mb"), "w1", "one")
        heartbeat.send({"name": "w1"})
        proxy.frozen.set()  # its answer held for 0.8 s, as if the worker were paused
        threading.Timer(0.8, proxy.frozen.clear).start()
        heartbeat.send({"name": "w1"})
        seconds, micros = redis_server.client().time()
        truth_ms = seconds * 1000 + micros / 1000
        assert abs(heartbeat.redis_now_ms() - truth_ms) < 100
    finally:
        proxy.close()
