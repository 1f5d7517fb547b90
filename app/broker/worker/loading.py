"""A broker worker's loads, beside what it serves: at most one worker of a host loads at a
time (``HostLock``, slots in Redis), so a host's cores serve while one of them loads.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Collection

import redis
from redis.exceptions import RedisError

from app.broker.wire.keys import STALE_S, Keys
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
    loader's (its worker's name and a token), that expire on their own within the load
    deadline. A slot whose holder is not loading is taken over: at once, one held by this
    worker's last life (it died loading, and starts again under its name); once the slot is
    older than ``STALE_S`` (its holder has heartbeaten since it took it), one held by a
    worker no longer live, or by a live worker whose heartbeat says it loads nothing (its
    release never reached the primary Redis has now: that primary died after it answered,
    or was away). A release that could not reach Redis is asked again each round
    (``settle``)."""

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
        self._unreleased: tuple[str, str] | None = None  # a release Redis did not take

    def take(self, live: Collection[str] = (), idle: Collection[str] = ()) -> bool:
        """True if this worker holds a slot now; ``live``: the names of the live workers,
        ``idle``: those whose heartbeat says they load nothing. Raises ``RedisError`` or
        ``OSError``."""
        self.settle()
        token = f"{self.owner}/{uuid.uuid4().hex}"
        for key in self.slots:
            if self.client.set(key, token, nx=True, px=self.timeout_ms):
                self._held = (key, token)
                return True
            with self.client.pipeline(transaction=False) as pipe:
                pipe.get(key)
                pipe.pttl(key)
                holder, ttl_ms = pipe.execute()
            if holder is None:
                continue
            name = text(holder).rsplit("/", 1)[0]
            age_s = (self.timeout_ms - ttl_ms) / 1000 if ttl_ms >= 0 else 0.0
            unused = name not in live or name in idle  # its heartbeat, older than the slot
            gone = name == self.owner or (unused and age_s > STALE_S)
            if gone and self._take_over(keys=[key], args=[holder, token, self.timeout_ms]):
                log.info("took over the host's load slot from %s, no longer loading", name)
                self._held = (key, token)
                return True
        return False

    def release(self) -> None:
        """Free the slot this worker holds; one Redis cannot take now is freed by a later
        ``settle`` (each round) or ``take``."""
        if self._held is None:
            return
        self._unreleased, self._held = self._held, None
        try:
            self._release_unreleased()
        except (RedisError, OSError) as exc:
            log.warning("could not release the host's load slot (asked again each round): %s",
                        exc)  # fmt: skip

    def settle(self) -> None:
        """Ask again for a release that could not reach Redis, if any."""
        with contextlib.suppress(RedisError, OSError):  # next round, else it expires
            self._release_unreleased()

    def _release_unreleased(self) -> None:
        if self._unreleased is not None:
            key, token = self._unreleased
            self._release(keys=[key], args=[token])
            self._unreleased = None
