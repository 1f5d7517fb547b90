"""What the fleet decided, shared in Redis: what the admin route chose (for each model name,
the version a load by the admin route pinned, or that it unloaded the name:
``app.lifecycle.AdminPin``), and the precision each export is served in (``Precisions``).

A front end's admin call writes the pin and bumps a sequence number in one script (``SET``);
every worker reads the number each round (one ``HGET``), and when it moved, reads the pins
and loads (or drains) what they choose, as on ``SIGHUP`` (a failed version is tried again).
A worker that starts later reads them before it loads anything: the operator's choice holds
for every worker, a restarted one too, until the admin route says otherwise.

Each pin carries the time Redis wrote it (``at``, ms on Redis's clock, and ``seq``, the
sequence number then), and a cleared pin stays as a tombstone with them: after a failover
that lost the last writes (or a restart that lost them all), front ends write back what
they knew (``restore_pins``), and for each name the later write wins, whoever made it, on
whichever primary.

    <prefix>:{w}:pins       hash: name -> {"version": N, "at": ms, "seq": S},
                            {"unloaded": true, ...} or {"cleared": true, ...}
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


def encode_pin(pin: AdminPin | None) -> str:
    """One field of the pins hash, before Redis stamps it (``SET`` adds ``at``); None: the
    pin cleared.

    >>> encode_pin(3), encode_pin("unloaded"), encode_pin(None)
    ('{"version": 3}', '{"unloaded": true}', '{"cleared": true}')
    """
    if pin is None:
        return json.dumps({"cleared": True})
    return json.dumps({"unloaded": True} if pin == UNLOADED else {"version": int(pin)})


def decode_pins(raw: Mapping[Any, Any]) -> dict[str, AdminPin]:
    """The pins hash as pins; a cleared pin is none, and a field that does not parse (or
    names no valid model) is left out: anyone who can write to Redis can write anything.

    >>> decode_pins({b"tagger": b'{"version": 2, "at": 5}', b"old": b'{"unloaded": true}',
    ...              b"x": b"{", b"gone": b'{"cleared": true, "at": 7}'})
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


def written_at(raw: str | bytes | None) -> tuple[int, int]:
    """When Redis wrote a pin: the time (ms on its clock) and the sequence number then (one
    Redis's writes within a millisecond, in order); (-1, 0) for none, (0, 0) for one
    without them.

    >>> written_at('{"version": 2, "at": 1700000000123, "seq": 7}'), written_at(None)
    ((1700000000123, 7), (-1, 0))
    """
    if raw is None:
        return (-1, 0)
    try:
        fields = json.loads(raw)
        at, seq = fields.get("at"), fields.get("seq", 0)
    except Exception:
        return (0, 0)
    if not isinstance(at, int) or not isinstance(seq, int) or at <= 0:
        return (0, 0)
    return (at, seq)


def later(*hashes: Mapping[str, str]) -> dict[str, str]:
    """The pins' fields of several readings, each name's latest (``written_at``).

    >>> later({"a": '{"version": 1, "at": 5, "seq": 2}'}, {"a": '{"cleared": true, "at": 5}'})
    {'a': '{"version": 1, "at": 5, "seq": 2}'}
    """
    fields: dict[str, str] = {}
    for each in hashes:
        for name, raw in each.items():
            if written_at(raw) >= written_at(fields.get(name)):
                fields[name] = raw
    return fields


# A pin stamped with Redis's time and the sequence bumped (KEYS: pins, pins-seq; ARGV: the
# name, its field without the time, ending in "}"): the new sequence and the field written.
SET = """
local t = redis.call('TIME')
local at = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
local seq = redis.call('HINCRBY', KEYS[2], 'seq', 1)
local raw = string.sub(ARGV[2], 1, -2) .. ', "at": ' .. at .. ', "seq": ' .. seq .. '}'
redis.call('HSET', KEYS[1], ARGV[1], raw)
return {seq, raw}
"""


async def set_pin(
    client: aioredis.Redis, keys: Keys, name: str, pin: AdminPin | None
) -> tuple[int, str]:
    """Set (or with None clear) ``name``'s pin and bump the sequence, in one script; the new
    sequence number and the field as written (``restore_pins`` may write it again). Raises
    ``RedisError`` or ``OSError``."""
    args = (check_name(name), encode_pin(pin))
    seq, raw = await client.eval(SET, 2, keys.pins, keys.pins_seq, *args)
    return int(seq), text(raw)


# Pins written again after a failover lost some (ARGV: name, field, name, field...;
# ARGV[#ARGV]: the sequence number the writer knew): each field whose time is later than
# the one Redis has for its name (or that it lacks) is written; the sequence moves if any
# was, and never stays below the number known, so every worker reads the pins again and an
# admin call waiting for that number sees it reached.
RESTORE = """
local function at(raw)
  if not raw then return -1, 0 end
  local ok, fields = pcall(cjson.decode, raw)
  if ok and type(fields) == 'table' and tonumber(fields['at']) then
    return tonumber(fields['at']), tonumber(fields['seq']) or 0
  end
  return 0, 0
end
local function older(raw, than)
  local at1, seq1 = at(raw)
  local at2, seq2 = at(than)
  return at1 < at2 or (at1 == at2 and seq1 < seq2)
end
local wrote = 0
for i = 1, #ARGV - 1, 2 do
  if older(redis.call('HGET', KEYS[1], ARGV[i]), ARGV[i + 1]) then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    wrote = wrote + 1
  end
end
local seq = tonumber(redis.call('HGET', KEYS[2], 'seq') or '0')
local floor = tonumber(ARGV[#ARGV])
if wrote > 0 or seq < floor then
  seq = math.max(seq + 1, floor)
  redis.call('HSET', KEYS[2], 'seq', seq)
end
return {seq, wrote}
"""


async def restore_pins(
    client: aioredis.Redis, keys: Keys, fields: Mapping[str, str], seq: int
) -> tuple[int, int]:
    """Write the pins ``fields`` (as ``set_pin`` returned them, or a look read them) again
    where Redis has none later (``RESTORE``), with the sequence at least ``seq``: the
    sequence number after, and how many were written. Raises ``RedisError`` or
    ``OSError``."""
    args: list[Any] = [a for name, raw in fields.items() for a in (check_name(name), raw)]
    answer, wrote = await client.eval(RESTORE, 2, keys.pins, keys.pins_seq, *args, seq)
    return int(answer), int(wrote)


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
