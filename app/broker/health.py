"""How a broker worker tells Redis it lives (and learns Redis's clock from it), and how it
reports trouble without flooding its log."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis

from app.broker.keys import Keys

log = logging.getLogger("app.worker")

# Sets this worker's heartbeat on Redis's clock and its description, in one step.
HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return now
"""


class Heartbeat:
    """One worker's heartbeat: its name on Redis's clock in a sorted set, its description in
    a hash, in one script call, which also returns Redis's time.

    Redis's clock = this host's monotonic clock + an offset renewed by every heartbeat:
    deadlines are judged on Redis's clock with no round trip per batch, and never against
    this host's wall clock.
    """

    def __init__(self, client: redis.Redis, keys: Keys, name: str) -> None:
        self.keys = keys
        self.name = name
        self._script = client.register_script(HEARTBEAT)
        self._offset_ms = 0.0

    def send(self, info: dict[str, Any]) -> None:
        """Raises ``RedisError`` or ``OSError`` when Redis cannot be reached."""
        before = time.monotonic()
        now_ms = self._script(
            keys=[self.keys.heartbeats, self.keys.worker_info],
            args=[self.name, json.dumps(info, separators=(",", ":"))],
        )
        self._offset_ms = float(now_ms) - 500 * (before + time.monotonic())

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
