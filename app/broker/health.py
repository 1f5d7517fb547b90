"""How a broker worker tells Redis it lives (and learns Redis's clock from it), that it alone
goes by its name, and how it reports trouble without flooding its log."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis

from app.broker.keys import STALE_S, Keys
from app.broker.wire import text

log = logging.getLogger("app.worker")

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


class Heartbeat:
    """One worker's heartbeat: its name on Redis's clock in a sorted set, its description in
    a hash, in one script call, which also returns Redis's time. The name is this process's
    alone: ``incarnation`` (new at each start) marks its heartbeats, and a heartbeat refused
    because another live incarnation holds the name raises ``NameTaken``.

    Redis's clock = this host's monotonic clock + an offset renewed by every heartbeat:
    deadlines are judged on Redis's clock with no round trip per batch, and never against
    this host's wall clock.
    """

    def __init__(self, client: redis.Redis, keys: Keys, name: str, incarnation: str) -> None:
        self.keys = keys
        self.name = name
        self.incarnation = incarnation
        self._script = client.register_script(HEARTBEAT)
        self._leave = client.register_script(LEAVE)
        self._offset_ms = 0.0

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
        self._offset_ms = float(answer) - 500 * (before + time.monotonic())

    def leave(self) -> None:
        """Take this worker's heartbeat out now (a clean exit), unless a successor holds it."""
        self._leave(
            keys=[self.keys.heartbeats, self.keys.worker_info], args=[self.name, self.incarnation]
        )

    def redis_now_ms(self) -> int:
        return int(1000 * time.monotonic() + self._offset_ms)


class TroubleLog:
    """A Redis outage logged once (and its end), an error at most once a minute."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._down = False
        self._logged: dict[str, float] = {}  # message -> when last logged

    def unreachable(self, exc: BaseException) -> None:
        if not self._down:
            log.warning("worker %s: Redis unreachable (%s); retrying", self.name, exc)
        self._down = True

    def reachable(self) -> None:
        if self._down:
            log.info("worker %s: Redis is back", self.name)
        self._down = False

    def error(self, message: str) -> None:
        now = time.monotonic()
        if now - self._logged.get(message, -60.0) >= 60.0:
            self._logged[message] = now
            if len(self._logged) > 1000:
                self._logged.clear()
            log.error("worker %s: %s", self.name, message)
