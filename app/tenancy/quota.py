"""Each tenant's quota: a token bucket of images, refilled at its rate up to its burst.

In one process the buckets live here (``LocalBuckets``); in broker mode in Redis
(``RedisBuckets``, at ``Keys.quota``: one Lua script, run atomically, on Redis's own clock),
so every front end
draws on one bucket per tenant. When Redis does not answer within ``REDIS_TIMEOUT_S`` a
front end draws on its own local bucket instead (each front end then allows up to the whole
quota), counts the error, and never fails the request for it.

>>> buckets = LocalBuckets(clock=iter([0.0, 0.0, 0.5]).__next__)
>>> share = Tenant("t", rate=2.0, burst=2.0)
>>> [buckets.take(share, 2).allowed, buckets.take(share, 1).allowed]
[True, False]
>>> buckets.take(share, 1).allowed   # half a second refilled one image
True
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.broker.wire.keys import Keys
from app.tenancy.keys import Tenant

if TYPE_CHECKING:
    import redis.asyncio as aioredis

log = logging.getLogger("app")

REDIS_TIMEOUT_S = 0.05  # longer than this and the request draws on the local bucket


@dataclass(frozen=True, slots=True)
class Verdict:
    """A draw on a bucket: allowed or not, what is left, and when it is worth trying again."""

    allowed: bool
    remaining: float  # images left in the bucket after this draw
    retry_after_s: float  # 0 when allowed: until ``cost`` images are back

    def headers(self, share: Tenant) -> dict[str, str]:
        """The IETF ``RateLimit-Policy`` and ``RateLimit`` fields (draft-ietf-httpapi-
        ratelimit-headers-10): a quota of ``burst`` images refilled over ``burst / rate``
        seconds, what remains, and the seconds until a retry can pass."""
        assert share.rate is not None
        window = max(1, math.ceil(share.burst / share.rate))
        reset = max(0, math.ceil(self.retry_after_s))
        return {
            "RateLimit-Policy": f'"{share.name}";q={int(share.burst)};w={window}',
            "RateLimit": f'"{share.name}";r={max(0, int(self.remaining))};t={reset}',
        }


class LocalBuckets:
    """Token buckets in this process, one per tenant."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._state: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, at)

    def take(self, share: Tenant, cost: int) -> Verdict:
        assert share.rate is not None
        now = self._clock()
        tokens, at = self._state.get(share.name, (share.burst, now))
        tokens = min(share.burst, tokens + max(0.0, now - at) * share.rate)
        allowed = tokens >= cost
        if allowed:
            tokens -= cost
        self._state[share.name] = (tokens, now)
        wait = 0.0 if allowed else (cost - tokens) / share.rate
        return Verdict(allowed, tokens, wait)

    async def draw(self, share: Tenant, cost: int) -> Verdict:
        """``take``, as ``RedisBuckets.draw`` is called."""
        return self.take(share, cost)


# KEYS[1]: the tenant's bucket; ARGV: rate, burst, cost. Redis's clock, so every front end
# agrees; floats travel as strings (Lua numbers come back as truncated integers).
TAKE_SCRIPT = """
local now = redis.call('TIME')
now = tonumber(now[1]) + tonumber(now[2]) / 1000000
local rate, burst, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1]) or burst
local at = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
local allowed = 0
if tokens >= cost then
  tokens = tokens - cost
  allowed = 1
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {allowed, tostring(tokens)}
"""


class RedisBuckets:
    """Token buckets in Redis under ``<prefix>:quota:<tenant>``, shared by every front end;
    ``fallback`` answers while Redis does not (``on_error`` is told each time)."""

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str,
        fallback: LocalBuckets,
        on_error: Callable[[], None] = lambda: None,
    ) -> None:
        self._client = client
        self._keys = Keys(prefix)
        self._script = client.register_script(TAKE_SCRIPT)
        self._fallback = fallback
        self._on_error = on_error

    @classmethod
    def connect(
        cls, url: str, prefix: str, fallback: LocalBuckets, on_error: Callable[[], None]
    ) -> RedisBuckets:
        """Buckets in the broker's Redis at ``url`` (Sentinel's too), through a client of
        their own: its timeouts are the request path's, not the broker's."""
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        from app.broker.wire.connect import connect_async

        client = connect_async(
            url,
            socket_timeout=REDIS_TIMEOUT_S,
            socket_connect_timeout=REDIS_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
        )
        return cls(client, prefix, fallback, on_error)

    async def draw(self, share: Tenant, cost: int) -> Verdict:
        """Take ``cost`` images from the tenant's bucket in Redis (or this process's)."""
        assert share.rate is not None
        key = self._keys.quota(share.name)
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                allowed, tokens = await self._script(
                    keys=[key], args=[repr(share.rate), repr(share.burst), cost]
                )
        except Exception as exc:
            self._on_error()
            log.warning("quota: Redis did not answer (%s); using this process's buckets", exc)
            return self._fallback.take(share, cost)
        left = float(tokens)
        wait = 0.0 if allowed else (cost - left) / share.rate
        return Verdict(bool(allowed), left, wait)

    async def aclose(self) -> None:
        await self._client.aclose()
