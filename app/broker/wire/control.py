"""What the fleet decided, shared in Redis: what the admin route chose (for each model name,
the version a load by the admin route pinned, or that it unloaded the name:
``app.lifecycle.AdminPin``), and the precision each export is served in (``Precisions``).

A front end's admin call writes the pin and bumps a sequence number in one transaction;
every worker reads the number each round (one ``HGET``), and when it moved, reads the pins
and loads (or drains) what they choose, as on ``SIGHUP`` (a failed version is tried again).
A worker that starts later reads them before it loads anything: the operator's choice holds
for every worker, a restarted one too, until the admin route says otherwise.

    <prefix>:{w}:pins       hash: name -> {"version": N} or {"unloaded": true}
    <prefix>:{w}:pins-seq   hash: "seq" -> a number bumped by every change
    <prefix>:{w}:precisions hash: export (model id) -> the dtype the fleet serves it in
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import redis
import redis.asyncio as aioredis

from app.broker.wire.keys import Keys
from app.broker.wire.parsing import text
from app.lifecycle import UNLOADED, AdminPin
from app.manifest import PRECISION_TAGS
from app.repository import check_name

SEQ = "seq"
DTYPE_NAMES = frozenset(PRECISION_TAGS)


def encode_pin(pin: AdminPin) -> str:
    """One field of the pins hash.

    >>> encode_pin(3), encode_pin("unloaded")
    ('{"version": 3}', '{"unloaded": true}')
    """
    return json.dumps({"unloaded": True} if pin == UNLOADED else {"version": int(pin)})


def decode_pins(raw: Mapping[Any, Any]) -> dict[str, AdminPin]:
    """The pins hash as pins; a field that does not parse (or names no valid model) is
    left out: anyone who can write to Redis can write anything.

    >>> decode_pins({b"tagger": b'{"version": 2}', b"old": b'{"unloaded": true}', b"x": b"{"})
    {'tagger': 2, 'old': 'unloaded'}
    """
    pins: dict[str, AdminPin] = {}
    for field, value in raw.items():
        try:
            name = check_name(text(field))
            fields = json.loads(value)
            if fields.get("unloaded") is True:
                pins[name] = UNLOADED
            elif isinstance(fields.get("version"), int) and fields["version"] >= 1:
                pins[name] = fields["version"]
        except Exception:  # malformed: ignored, never trusted
            continue
    return pins


async def set_pin(client: aioredis.Redis, keys: Keys, name: str, pin: AdminPin | None) -> int:
    """Set (or with None clear) ``name``'s pin and bump the sequence, in one transaction;
    returns the new sequence number. Raises ``RedisError`` or ``OSError``."""
    async with client.pipeline(transaction=True) as pipe:
        if pin is None:
            pipe.hdel(keys.pins, check_name(name))
        else:
            pipe.hset(keys.pins, check_name(name), encode_pin(pin))
        pipe.hincrby(keys.pins_seq, SEQ, 1)
        answers = await pipe.execute()
    return int(answers[-1])


# Pins written again after a failover lost them (ARGV: name, pin, name, pin...; ARGV[#ARGV]:
# the sequence number they had): the sequence moves past it, so every worker acts on them
# and an admin call waiting for that number sees it reached.
RESTORE = """
for i = 1, #ARGV - 1, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
local seq = redis.call('HINCRBY', KEYS[2], 'seq', 1)
local floor = tonumber(ARGV[#ARGV])
if seq < floor then
  redis.call('HSET', KEYS[2], 'seq', floor)
  seq = floor
end
return seq
"""


async def restore_pins(
    client: aioredis.Redis, keys: Keys, pins: Mapping[str, AdminPin], seq: int
) -> int:
    """Write ``pins`` again, with the sequence at least ``seq`` (``RESTORE``); the new
    sequence number. Raises ``RedisError`` or ``OSError``."""
    args: list[Any] = [a for n, p in pins.items() for a in (check_name(n), encode_pin(p))]
    answer = await client.eval(RESTORE, 2, keys.pins, keys.pins_seq, *args, seq)
    return int(answer)


async def bump(client: aioredis.Redis, keys: Keys) -> int:
    """Have every worker read the pins and the repository again now, as on ``SIGHUP`` (a
    failed version is tried again): the sequence is bumped, the pins stay. Returns the new
    sequence number. Raises ``RedisError`` or ``OSError``."""
    return int(await client.hincrby(keys.pins_seq, SEQ, 1))


class PinReader:
    """A worker's reader of the pins: ``changed()`` (one round trip) says whether they
    moved since the last ``read()``.

    >>> # reader = PinReader(client, keys); pins = reader.read()
    >>> # if reader.changed(): pins = reader.read()
    """

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._seen: int | None = None

    def _seq(self) -> int:
        raw = self.client.hget(self.keys.pins_seq, SEQ)
        return int(raw) if raw is not None else 0

    @property
    def seen(self) -> int:
        """The sequence number of the pins at the last ``read`` (0 before any)."""
        return self._seen or 0

    def changed(self) -> bool:
        """Whether an admin call changed the pins since the last read. Raises
        ``RedisError`` or ``OSError``."""
        return self._seq() != self._seen

    def read(self) -> dict[str, AdminPin]:
        """The pins now (and the sequence they are at). Raises ``RedisError`` or
        ``OSError``."""
        with self.client.pipeline(transaction=True) as pipe:
            pipe.hget(self.keys.pins_seq, SEQ)
            pipe.hgetall(self.keys.pins)
            seq, raw = pipe.execute()
        self._seen = int(seq) if seq is not None else 0
        return decode_pins(raw)


class Precisions:
    """The precision each export is served in, fleet-wide, under ``MB_DTYPE=auto``: the
    first worker to load an export chooses it by measurement on its host and records it;
    every later worker loads that one (a host that cannot compute it, bf16 on a CPU without
    bf16 units, serves fp32 under an id of its own). One id per version across the fleet."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self.key = keys.precisions

    def read(self, model_id: str) -> str | None:
        """The recorded precision of ``model_id``'s export, if any. Raises ``RedisError``
        or ``OSError``."""
        raw = self.client.hget(self.key, model_id)
        value = text(raw) if raw is not None else None
        return value if value in DTYPE_NAMES else None

    def record(self, model_id: str, dtype: str) -> str:
        """Record ``dtype`` unless another worker recorded first: the fleet's precision.
        Raises ``RedisError`` or ``OSError``."""
        with self.client.pipeline(transaction=True) as pipe:
            pipe.hsetnx(self.key, model_id, dtype)
            pipe.hget(self.key, model_id)
            _, raw = pipe.execute()
        return text(raw) if raw is not None and text(raw) in DTYPE_NAMES else dtype
