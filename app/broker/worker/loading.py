"""A broker worker's loads, beside what it serves: at most one worker of a host loads at a
time (``HostLock``, slots in Redis), so a host's cores serve while one of them loads.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Collection

import redis
from redis.exceptions import RedisError

from app.broker.wire.keys import Keys
from app.broker.wire.parsing import text
from app.lifecycle import LOADERS_PER_HOST

log = logging.getLogger("app.worker")

RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
TAKE_OVER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
return false
"""


class HostLock:
    """At most ``LOADERS_PER_HOST`` loaders per host: as many keys in Redis, each one
    loader's (its worker's name and a token), that expire on their own. A slot whose holder
    is gone is taken over at once: one held by this worker's last life (it died loading, and
    starts again under its name), or by a worker no longer live; else a worker that dies
    holding one frees it within the load deadline."""

    def __init__(
        self, client: redis.Redis, keys: Keys, host: str, timeout_s: float, owner: str = ""
    ) -> None:
        self.client = client
        self.owner = owner  # this worker's name
        self.slots = [f"{keys.loading(host)}:{slot}" for slot in range(LOADERS_PER_HOST)]
        self.timeout_ms = int(1000 * timeout_s)
        self._release = client.register_script(RELEASE)
        self._take_over = client.register_script(TAKE_OVER)
        self._held: tuple[str, str] | None = None  # (key, token)

    def take(self, live: Collection[str] = ()) -> bool:
        """True if this worker holds a slot now; ``live``: the names of the live workers.
        Raises ``RedisError`` or ``OSError``."""
        token = f"{self.owner}/{uuid.uuid4().hex}"
        for key in self.slots:
            if self.client.set(key, token, nx=True, px=self.timeout_ms):
                self._held = (key, token)
                return True
            holder = self.client.get(key)
            if holder is None:
                continue
            name = text(holder).rsplit("/", 1)[0]
            gone = name == self.owner or name not in live
            if gone and self._take_over(keys=[key], args=[holder, token, self.timeout_ms]):
                log.info("took over the host's load slot from %s, no longer loading", name)
                self._held = (key, token)
                return True
        return False

    def release(self) -> None:
        if self._held is None:
            return
        (key, token), self._held = self._held, None
        try:
            self._release(keys=[key], args=[token])
        except (RedisError, OSError) as exc:  # it expires on its own
            log.warning("could not release the host's load slot: %s", exc)
