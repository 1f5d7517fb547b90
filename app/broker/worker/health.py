"""How a broker worker tells Redis it lives (and learns Redis's clock from it), that it alone
goes by its name, how it reports trouble without flooding its log, and the threads whose
death must end it."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from redis.exceptions import RedisError

from app.broker.wire.connect import BACKOFF, follow_primary
from app.broker.wire.keys import HEARTBEAT_S, STALE_S, Keys
from app.broker.wire.parsing import text
from app.broker.worker.stats import ConsumerStats

log = logging.getLogger("app.worker")

# A worker whose name another live process holds waits this long (an earlier life's last
# heartbeat goes stale in STALE_S), then exits with this code.
JOIN_TIMEOUT_S = 2 * STALE_S + 1.0
NAME_TAKEN_EXIT = 3

# Sets this worker's heartbeat on Redis's clock and its description, in one step; unless
# another process (another incarnation, ARGV[3]) holds the name with a heartbeat younger than
# ARGV[4] ms: then nothing is written, and the holder's pid and host come back.
HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local last = redis.call('ZSCORE', KEYS[1], ARGV[1])
if last and now - tonumber(last) < tonumber(ARGV[4]) then
  local raw = redis.call('HGET', KEYS[2], ARGV[1])
  local ok, held = pcall(cjson.decode, raw or '')
  if ok and type(held) == 'table' and held['incarnation'] and held['incarnation'] ~= ARGV[3] then
    return {tostring(held['pid']), tostring(held['host']), now - tonumber(last)}
  end
end
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return now
"""
# Takes the heartbeat out, if it is this incarnation's (not a successor's).
LEAVE = """
local raw = redis.call('HGET', KEYS[2], ARGV[1])
local ok, held = pcall(cjson.decode, raw or '')
if ok and type(held) == 'table' and held['incarnation'] == ARGV[2] then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
  return 1
end
return 0
"""


class NameTaken(Exception):
    """Another live process goes by this worker's name: this one must not consume under it."""

    def __init__(self, name: str, pid: str, host: str, age_ms: int) -> None:
        super().__init__(
            f"worker name {name} is held by a live process (pid {pid} on {host}, heartbeat "
            f"{age_ms} ms ago): not joining as a second consumer under it"
        )


class RedisClock:
    """Redis's clock, read on this host's monotonic clock plus an offset: deadlines are
    judged on Redis's clock with no round trip per batch, and never against this host's wall
    clock. Each reading of Redis's time (``heard``: it answered ``redis_ms`` between
    ``before_s`` and ``after_s``) bounds the offset by the round trip; the bounds of
    successive readings are intersected (widened by ``DRIFT`` of the time between them), and
    the offset is the middle of what is left. So a slow round trip (the process paused or
    throttled, a busy host) never moves it by more than the fastest one allows; bounds that
    do not meet (another Redis after a failover, its clock stepped) start it afresh.

    >>> clock = RedisClock()
    >>> clock.heard(5_000, before_s=1.0, after_s=1.002)  # a 2 ms round trip
    >>> clock.heard(6_000, before_s=2.0, after_s=3.0)  # answered at once, read 1 s later
    >>> clock.now_ms(3.0)  # Redis says 7000 then; the second reading alone says 6500
    6999
    """

    DRIFT = 0.0005  # how far two clocks may slew apart per second (NTP's most: 500 ppm)

    def __init__(self) -> None:
        self._low = self._high = 0.0  # the offset's bounds, ms
        self._at: float | None = None  # when they were last narrowed (monotonic s)

    def heard(self, redis_ms: float, *, before_s: float, after_s: float) -> None:
        low, high = redis_ms - 1000 * after_s, redis_ms + 1 - 1000 * before_s  # ms: truncated
        if self._at is not None:
            slack = 1000 * self.DRIFT * max(0.0, after_s - self._at)
            low_, high_ = max(low, self._low - slack), min(high, self._high + slack)
            if low_ <= high_:
                low, high = low_, high_
        self._low, self._high, self._at = low, high, after_s

    def now_ms(self, monotonic_s: float | None = None) -> int:
        at = time.monotonic() if monotonic_s is None else monotonic_s
        return int(1000 * at + (self._low + self._high) / 2)


class Heartbeat:
    """One worker's heartbeat: its name on Redis's clock in a sorted set, its description in
    a hash, in one script call, which also returns Redis's time (``clock``, a
    ``RedisClock``). The name is this process's alone: ``incarnation`` (new at each start)
    marks its heartbeats, and a heartbeat refused because another live incarnation holds the
    name raises ``NameTaken``.
    """

    def __init__(self, client: redis.Redis, keys: Keys, name: str, incarnation: str) -> None:
        self.client = client
        self.keys = keys
        self.name = name
        self.incarnation = incarnation
        self._script = client.register_script(HEARTBEAT)
        self._leave = client.register_script(LEAVE)
        self.clock = RedisClock()

    def send(self, info: dict[str, Any]) -> None:
        """Raises ``NameTaken``, or ``RedisError`` or ``OSError`` when Redis cannot be
        reached."""
        before = time.monotonic()
        answer = self._script(
            keys=[self.keys.heartbeats, self.keys.worker_info],
            args=[
                self.name,
                json.dumps({**info, "incarnation": self.incarnation}, separators=(",", ":")),
                self.incarnation,
                int(1000 * STALE_S),
            ],
        )
        if isinstance(answer, list):
            pid, host, age_ms = answer
            raise NameTaken(self.name, text(pid), text(host), int(age_ms))
        self.clock.heard(float(answer), before_s=before, after_s=time.monotonic())

    def leave(self) -> None:
        """Take this worker's heartbeat out now (a clean exit), unless a successor holds it."""
        self._leave(
            keys=[self.keys.heartbeats, self.keys.worker_info], args=[self.name, self.incarnation]
        )

    def redis_now_ms(self) -> int:
        return self.clock.now_ms()


class Presence:
    """A worker's presence in Redis as a whole: it takes its name (``join``), says it lives
    with what ``describe`` gives (``send``, every second from its heartbeat thread), and
    leaves. Never two processes under one name: another live one holding it ends this one
    (``NAME_TAKEN_EXIT``; its supervisor retries with backoff)."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        name: str,
        describe: Callable[[], dict[str, Any]],
        trouble: TroubleLog,
    ) -> None:
        self.name = name
        self.heartbeat = Heartbeat(client, keys, name, uuid.uuid4().hex)
        self._describe = describe
        self._trouble = trouble

    def join(self, stop: threading.Event) -> bool:
        """Take this worker's name with a first heartbeat, before reading anything: if a live
        process holds it (an earlier life still exiting, or a second process started under
        the same name), wait up to ``JOIN_TIMEOUT_S`` for its heartbeat to go stale, then
        exit with ``NAME_TAKEN_EXIT``. False if told to stop meanwhile."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not stop.is_set():
            try:
                self.send(raising=True)
                return True
            except NameTaken as exc:
                self._trouble.error(str(exc))
                if time.monotonic() > deadline:
                    log.error("worker %s: %s; exiting", self.name, exc)
                    sys.exit(NAME_TAKEN_EXIT)
            time.sleep(HEARTBEAT_S)
        return False

    def send(self, *, raising: bool = False) -> None:
        """Tell Redis this worker lives (behind Sentinel, to the primary it names now:
        ``follow_primary``, every heartbeat, whatever the worker computes). Another live
        process holding the name ends this one (``raising``: the caller decides)."""
        try:
            follow_primary(self.heartbeat.client)
            self.heartbeat.send(self._describe())
        except NameTaken as exc:
            if raising:
                raise
            log.error("worker %s: %s; exiting", self.name, exc)
            os._exit(NAME_TAKEN_EXIT)
        except (RedisError, OSError) as exc:  # checked again at the next heartbeat
            self._trouble.unreachable(exc)
        else:
            self._trouble.reachable()

    def leave(self) -> None:
        """A clean exit: this worker's heartbeat goes now, not after it goes stale."""
        try:
            self.heartbeat.leave()
        except (RedisError, OSError) as exc:
            self._trouble.unreachable(exc)

    def redis_now_ms(self) -> int:
        return self.heartbeat.redis_now_ms()


class TroubleLog:
    """A Redis outage logged once (and its end, counted in ``stats.reconnects``), the pause
    before a thread tries again (``pause``: backing off while the failures go on), an error
    at most once a minute."""

    def __init__(
        self, name: str, stats: ConsumerStats, on_down: Callable[[], None] = lambda: None
    ) -> None:
        self.name = name
        self.stats = stats
        self._on_down = on_down  # at the first failure of an outage
        self._failures = 0  # in a row, over every thread
        self._down = False
        self._logged: dict[str, float] = {}  # message -> when last logged

    def unreachable(self, exc: BaseException) -> None:
        if not self._down:
            log.warning("worker %s: Redis unreachable (%s); retrying", self.name, exc)
            self._on_down()
        self._down = True
        self._failures += 1

    def pause(self) -> None:
        """Wait before trying Redis again (``BACKOFF``, after the failures so far)."""
        time.sleep(BACKOFF.compute(max(1, self._failures)))

    def reachable(self) -> None:
        if self._down:
            log.info("worker %s: Redis is back", self.name)
            self.stats.reconnects += 1
        self._down = False
        self._failures = 0

    def error(self, message: str) -> None:
        now = time.monotonic()
        if now - self._logged.get(message, -60.0) >= 60.0:
            self._logged[message] = now
            if len(self._logged) > 1000:
                self._logged.clear()
            log.error("worker %s: %s", self.name, message)


class PrimaryWatch:
    """Which Redis process answers (``INFO``'s ``run_id``): another one means a failover
    to a replica, or a restart, and what the last one held may be partly lost."""

    def __init__(self) -> None:
        self._run_id: str | None = None

    def changed(self, client: redis.Redis) -> bool:
        """Whether another Redis answers than at the last call (False when none does)."""
        try:
            run_id = str(client.info("server").get("run_id"))
        except (RedisError, OSError):
            return False
        before, self._run_id = self._run_id, run_id
        return before is not None and before != run_id


def vital_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread whose unexpected death ends the process: a worker that reads nothing
    while its heartbeats go on would look ready forever. Its supervisor restarts it."""

    def guarded() -> None:
        try:
            target()
        except BaseException:
            log.exception("the %s thread failed; exiting so the worker restarts", name)
            os._exit(71)

    thread = threading.Thread(target=guarded, name=name, daemon=True)
    thread.start()
    return thread
