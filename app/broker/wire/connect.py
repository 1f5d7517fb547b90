"""The one way every broker process connects to Redis (``connect``, ``connect_async``), at
the address ``MB_BROKER`` gives (``app.settings_values.BrokerAddress``): a plain URL, or
Sentinel's (``redis+sentinel://``, ``rediss+sentinel://``), whose clients follow the primary
through every failover.

``redis+sentinel://[user:password@]host:port[,host:port...]/<service>[/<db>][?options]``:
the Sentinels' addresses, the service (the primary's name in Sentinel's configuration), and
the same options as a plain URL (redis-py's: ``ssl_ca_certs``, ``ssl_certfile``,
``ssl_keyfile``...), which apply to the Sentinels too; ``sentinel_username`` and
``sentinel_password`` where the Sentinels ask for their own credentials. The user and
password are the data nodes' (an ACL user per role, docs/scaling.md).

Following the primary takes more than redis-py does by itself, and each piece closes a way
to write to a primary Sentinel no longer names (whose writes a failover then loses): the
newest configuration the Sentinels tell, not the first answer (``_newest``); a connection
checked once made (``_Checked``); connections to the last primary closed when given back
(``_AsyncPool``), when Sentinel names another (``follow_primary``, every second) and, idle
ones, at the first failure (``drop_idle``).

Every connection has a socket timeout (each caller's, above its longest blocking read) and
TCP keepalive, so a primary that hangs without closing its sockets is left within
``socket_timeout`` (a blocking read) or ``KEEPALIVE_BOUND_S`` (an idle connection)."""

from __future__ import annotations

import socket
from collections import Counter
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel
from redis.backoff import EqualJitterBackoff

from app.settings_values import BrokerAddress

# TCP keepalive: probes after KEEPIDLE s of silence, every KEEPINTVL s, KEEPCNT of them.
KEEPIDLE, KEEPINTVL, KEEPCNT = 2, 1, 3
KEEPALIVE_BOUND_S = KEEPIDLE + KEEPINTVL * KEEPCNT
# Reconnects after the n-th failure in a row wait base * 2^n, half of it jittered, capped
# (redis-py's): 0.05-0.1 s after the first, 0.5-1 s from the fourth on.
BACKOFF = EqualJitterBackoff(cap=1.0, base=0.1)


def _keepalive() -> dict[str, Any]:
    options = {}
    for name, value in (
        ("TCP_KEEPIDLE", KEEPIDLE),
        ("TCP_KEEPINTVL", KEEPINTVL),
        ("TCP_KEEPCNT", KEEPCNT),
    ):
        if hasattr(socket, name):  # Linux has all three; others may not
            options[getattr(socket, name)] = value
    return {"socket_keepalive": True, "socket_keepalive_options": options}


def connect(url: str, *, socket_timeout: float, **kwargs: Any) -> redis.Redis:
    """A client of the broker at ``url`` for one thread's calls (workers, probes)."""
    self = BrokerAddress.parse(url)
    kwargs |= {"socket_timeout": socket_timeout, **_keepalive()}
    if not self.sentinel:
        return redis.Redis.from_url(self.url, **kwargs)
    manager = _Sentinel(  # type: ignore[no-untyped-call]
        list(self.sentinels), sentinel_kwargs=_sentinel_kwargs(self, kwargs)
    )
    checked = _CheckedSSL if self.options.get("ssl") else _Checked
    client: redis.Redis = manager.master_for(  # type: ignore[no-untyped-call]
        self.service, connection_class=checked, **self.options, **kwargs
    )
    return client


def connect_async(url: str, *, socket_timeout: float, **kwargs: Any) -> aioredis.Redis:
    """A client of the broker at ``url`` for an event loop's calls (front ends)."""
    self = BrokerAddress.parse(url)
    kwargs |= {"socket_timeout": socket_timeout, **_keepalive()}
    if not self.sentinel:
        return aioredis.Redis.from_url(self.url, **kwargs)
    manager = _AsyncSentinel(  # type: ignore[no-untyped-call]
        list(self.sentinels), sentinel_kwargs=_sentinel_kwargs(self, kwargs)
    )
    checked = _AsyncCheckedSSL if self.options.get("ssl") else _AsyncChecked
    client: aioredis.Redis = manager.master_for(
        self.service,
        connection_pool_class=_AsyncPool,
        connection_class=checked,
        **self.options,
        **kwargs,
    )
    return client


def _sentinel_kwargs(address: BrokerAddress, kwargs: dict[str, Any]) -> dict[str, Any]:
    """How to reach the Sentinels: the same timeouts and TLS, their own credentials."""
    timeouts = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
    return timeouts | address.sentinel_options


def _newest(states: list[dict[str, Any]], service: str, errors: list[str]) -> tuple[str, int]:
    """The primary of the newest configuration the Sentinels told (``config-epoch``: each
    failover raises it), as most of those that tell it say; none in the middle of a
    failover (its leader names the last primary meanwhile). redis-py takes the first
    Sentinel's word: one that has not yet heard of a failover names the last primary, and
    once that one resumes a client writes to it, and what it writes there is lost."""
    settled = [s for s in states if "failover_in_progress" not in str(s.get("flags", ""))]
    if not settled:
        detail = f": {', '.join(errors)}" if errors else ""
        raise redis.sentinel.MasterNotFoundError(f"No master found for {service!r}{detail}")
    epoch = max(int(s.get("config-epoch", 0)) for s in settled)
    named = Counter((s["ip"], s["port"]) for s in settled if int(s.get("config-epoch", 0)) == epoch)
    return named.most_common(1)[0][0]


class _Sentinel(redis.sentinel.Sentinel):
    """Asks every Sentinel, and follows the newest configuration (``_newest``)."""

    def discover_master(self, service_name: str) -> tuple[str, int]:
        states, errors = [], []
        for sentinel in self.sentinels:
            try:
                masters: Any = sentinel.sentinel_masters()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                errors.append(f"{sentinel} - {exc!r}")
                continue
            state = masters.get(service_name)
            if state and self.check_master_state(state, service_name):  # type: ignore[no-untyped-call]
                states.append(state)
        return _newest(states, service_name, errors)


class _AsyncSentinel(aiosentinel.Sentinel):
    """``_Sentinel`` for an event loop's client."""

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        states, errors = [], []
        for sentinel in self.sentinels:
            try:
                masters: Any = await sentinel.sentinel_masters()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                errors.append(f"{sentinel} - {exc!r}")
                continue
            state = masters.get(service_name)
            if state and self.check_master_state(state, service_name):
                states.append(state)
        return _newest(states, service_name, errors)


class _Checked(redis.sentinel.SentinelManagedConnection):
    """A connection to the primary Sentinel names, checked once made: a connection begun to
    a primary that hung, and made once it resumed, after Sentinel had named another, is
    closed (``ConnectionError``) rather than used (what it would write there is lost)."""

    def connect_to(self, address: Any) -> None:
        super().connect_to(address)  # type: ignore[no-untyped-call]
        named = self.connection_pool.get_master_address()
        if named != address:
            self.disconnect()  # type: ignore[no-untyped-call]
            raise redis.ConnectionError(f"{address} is not the primary any more ({named} is)")


class _CheckedSSL(_Checked, redis.connection.SSLConnection):
    pass


class _AsyncChecked(aiosentinel.SentinelManagedConnection):
    """``_Checked`` for an event loop's client."""

    async def connect_to(self, address: Any) -> None:
        await super().connect_to(address)  # type: ignore[no-untyped-call]
        named = await self.connection_pool.get_master_address()
        if named != address:
            await self.disconnect()
            raise redis.ConnectionError(f"{address} is not the primary any more ({named} is)")


class _AsyncCheckedSSL(_AsyncChecked, aioredis.SSLConnection):
    pass


class _AsyncPool(aiosentinel.SentinelConnectionPool):
    """A connection given back after Sentinel named another primary is closed (it connects
    again to the one named now when next used), as redis-py's threaded pool does; its
    asyncio pool would keep it, and go on writing to the last primary."""

    async def release(self, connection: Any) -> None:
        await super().release(connection)
        if self.master_address is not None and self.master_address != (
            connection.host,
            connection.port,
        ):
            await connection.disconnect()


def drop_idle(client: redis.Redis) -> None:
    """Close the connections ``client`` holds idle, for the first failure of an outage: one
    to a primary that hung (stopped, not dead) would otherwise be used once it resumes, a
    primary of its own until Sentinel demotes it. Those in use are their callers' (another
    thread may be reading one): on a hung primary their command times out, and closes them."""
    client.connection_pool.disconnect(inuse_connections=False)


async def drop_idle_async(client: aioredis.Redis) -> None:
    """``drop_idle`` for an event loop's client."""
    await client.connection_pool.disconnect(inuse_connections=False)


def follow_primary(client: redis.Redis) -> None:
    """Behind Sentinel, ask it which primary to use now (a plain URL: nothing to do). A new
    one closes the idle connections to the last one and disowns those in use (closed when
    released): so no connection outlives by more than a call of this a primary Sentinel no
    longer names. One that hung and resumed is a primary of its own until Sentinel demotes
    it, and what it takes meanwhile is lost (split brain). Raises ``RedisError``
    (``MasterNotFoundError``: none named now) or ``OSError``."""
    ask = getattr(client.connection_pool, "get_master_address", None)
    if ask is not None:
        ask()


async def follow_primary_async(client: aioredis.Redis) -> None:
    """``follow_primary`` for an event loop's client."""
    ask = getattr(client.connection_pool, "get_master_address", None)
    if ask is not None:
        await ask()
