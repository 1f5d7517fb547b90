"""What a broker front end does when its Redis goes away, or another one answers.

A plain Redis that drops the connection, or comes back with another ``run_id`` (restarted
without persistence), has lost what it held: every waiting request fails at once, 503
``broker_unavailable``.

Behind Sentinel (``redis+sentinel://``), the same events are a failover: a replica becomes
the primary with what it had received. Replication is asynchronous, so the last writes
before the fault may be missing there: an entry added (its request then never computed),
or an answer's reply and acknowledgement (its entry then delivered again). So waiting
requests are held through it, up to ``HOLD_S``, and once a primary answers, each one's
entry is looked for (``recheck``):

- there, and its own: a worker computes it (one that had answered it before computes it
  again; the front end takes one reply per request, and drops the second);
- gone, with its reply in the list: delivered;
- gone, no reply: lost in the failover; sent again (the same request id and fields, the time
  left before its deadline, and its lane described again with its doorbell: a lane new to
  the workers was lost with it) if its deadline leaves ``RESEND_MIN_S``, else failed with
  503 ``broker_unavailable`` saying so.

And again every second for ``SETTLE_S``: a connection to the last primary, in use while it
hung and answered once it resumed (a primary of its own until Sentinel demotes it), may have
added a few entries there before it was closed. A request that still has no reply just
before its deadline hears that the broker failed over (503), not a plain 504.

Every waiting request so gets one answer: its result, or a typed refusal, by its deadline.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from app.broker.front.waiting import Entry, LaneNote, Waiting
from app.broker.wire.request import with_ttl
from app.errors import BrokerUnavailable

log = logging.getLogger("app.broker.transport")

HOLD_S = 30.0  # behind Sentinel: the longest waiting requests are held for a primary
# Entries are looked for again a second after each look this long after a failover: a
# connection to the last primary may have taken a few more before it was closed.
SETTLE_S = 5.0
RESEND_MIN_S = 0.2  # a lost entry is sent again only if its deadline leaves this long


class Failover:
    """One front end's failure policy (see the module's docstring): ``hold`` behind
    Sentinel, else fail at once. ``on_event(name)`` counts ``reconnect``, ``resent`` and
    ``lost`` (metrics)."""

    def __init__(
        self, waiting: Waiting, *, hold: bool, on_event: Callable[[str], None] | None = None
    ) -> None:
        self.waiting = waiting
        self.hold = hold
        self.on_event = on_event or (lambda event: None)
        self.lost_since: float | None = None  # the reply reader has not reached Redis since
        self.recheck_due = False  # entries to look for, once a primary answers
        self.again_at: float | None = None  # and again then (``SETTLE_S``)
        self.disturbed_at = -math.inf  # behind Sentinel: when Redis was last lost or changed

    def due(self) -> bool:
        """Whether the entries of the waiting requests are to be looked for now."""
        return self.recheck_due or (self.again_at is not None and time.monotonic() >= self.again_at)

    def disturbed_since(self, since: float) -> bool:
        """Whether a failover began, or went on, since ``since`` (time.monotonic())."""
        return self.hold and (self.lost_since is not None or self.disturbed_at >= since)

    @staticmethod
    def too_late() -> BrokerUnavailable:
        return BrokerUnavailable(
            "the broker (Redis) failed over while this request waited, and no reply came "
            "before its deadline",
            retry_after_s=1,
        )

    def lost(self, exc: BaseException) -> None:
        """The reply reader could not reach Redis."""
        now = time.monotonic()
        first = self.lost_since is None
        if first:
            self.lost_since = now
        if not self.hold:
            if self.waiting:
                log.error("broker: lost Redis (%s); failing %d waiting request(s)", exc,
                          len(self.waiting))  # fmt: skip
            self.waiting.fail(BrokerUnavailable("lost the broker (Redis) while waiting"))
            return
        self.recheck_due = True
        self.disturbed_at = now
        if first:
            log.warning("broker: lost Redis (%s); holding %d waiting request(s) for a primary "
                        "(up to %.0f s)", exc, len(self.waiting), HOLD_S)  # fmt: skip
        assert self.lost_since is not None
        if now - self.lost_since > HOLD_S and self.waiting:
            log.error("broker: no Redis primary for %.0f s; failing %d waiting request(s)",
                      HOLD_S, len(self.waiting))  # fmt: skip
            gone = f"the broker (Redis) failed over and no primary came back in {HOLD_S:.0f} s"
            self.waiting.fail(BrokerUnavailable(gone))

    def reached(self) -> None:
        """The reply reader reached Redis again."""
        if self.lost_since is not None:
            self.lost_since = None
            self.on_event("reconnect")
            log.info("broker: Redis reached again")

    def restarted(self) -> None:
        """Another Redis answers than at the last look: a failover behind Sentinel (look for
        the entries), a restart of a plain one (what it held is gone)."""
        if self.hold:
            self.recheck_due = True
            self.disturbed_at = time.monotonic()
        else:
            self.waiting.fail(BrokerUnavailable("Redis restarted"))

    async def recheck(
        self, client: aioredis.Redis, replies: str, deliver: Callable[[Any], None]
    ) -> None:
        """Look for every waiting request's entry on the primary that answers now (see the
        module's docstring); raises ``RedisError`` or ``OSError`` (and is due again)."""
        doubtful = self.waiting.entries()
        found: list[Any] = []
        if doubtful:
            async with client.pipeline(transaction=False) as pipe:
                for _, entry in doubtful:
                    pipe.xrange(entry.stream, entry.entry_id, entry.entry_id)
                found = await pipe.execute()
        # The replies already there, before an entry is judged missing: a worker deletes
        # an entry and adds its reply in one step.
        while popped := await client.lpop(replies, 512):
            for raw in popped if isinstance(popped, list) else [popped]:
                deliver(raw)
        resent = lost = 0
        for (request_id, entry), there in zip(doubtful, found, strict=True):
            if request_id not in self.waiting or _holds(there, entry):
                continue
            now = time.monotonic()  # each resend waits on those before it
            if entry.deadline is not None and entry.deadline - now < RESEND_MIN_S:
                lost += 1
                self.on_event("lost")
                self.waiting.fail_one(
                    request_id,
                    BrokerUnavailable("the broker (Redis) failed over and lost this request; "
                                      "its deadline leaves no time to send it again"),
                )  # fmt: skip
                continue
            fields = entry.fields
            if entry.deadline is not None:
                fields = with_ttl(fields, int(1000 * (entry.deadline - now)))
            added = await resend(client, entry.stream, fields, entry.lane)
            if request_id not in self.waiting:  # its caller left meanwhile: nobody to compute for
                with contextlib.suppress(RedisError, OSError):
                    await client.xdel(entry.stream, added)
                continue
            self.waiting.sent(
                request_id, Entry(entry.stream, added, fields, entry.deadline, entry.lane)
            )
            resent += 1
            self.on_event("resent")
        self.recheck_due = False
        now = time.monotonic()
        self.again_at = now + 1.0 if now - self.disturbed_at < SETTLE_S else None
        if doubtful and (resent or lost):
            log.warning("broker: after a failover, of %d waiting request(s) %d were lost and "
                        "sent again, %d were lost too late to", len(doubtful), resent,
                        lost)  # fmt: skip


# A lost request added again, as the admission script added it (it was admitted: no bound):
# KEYS[1] its stream; for a lane, KEYS[2] its version's lanes hash and KEYS[3] its task's
# stream, where a doorbell tells the workers of a lane new to them. ARGV: the fields h and
# img, the lane's description.
RESEND = """
local id = redis.call('XADD', KEYS[1], '*', 'h', ARGV[1], 'img', ARGV[2])
if #KEYS == 3 and redis.call('HSET', KEYS[2], KEYS[1], ARGV[3]) == 1 then
  redis.call('XADD', KEYS[3], '*', 'lane', KEYS[1])
end
return id
"""


async def resend(
    client: aioredis.Redis, stream: str, fields: dict[str, bytes], lane: LaneNote | None
) -> bytes:
    """Add a lost request's entry again (``RESEND``); the new entry's id. Raises
    ``RedisError`` or ``OSError``."""
    if lane is None:
        return await client.eval(RESEND, 1, stream, fields["h"], fields["img"])  # type: ignore[no-any-return]
    keys = (stream, lane.lanes, lane.doorbell)
    return await client.eval(RESEND, 3, *keys, fields["h"], fields["img"], lane.description)  # type: ignore[no-any-return]


def _holds(there: Any, entry: Entry) -> bool:
    """Whether XRANGE's answer is the request's own entry (an id alone could be reused by
    a new primary's clock)."""
    return bool(there) and there[0][1].get(b"h") == entry.fields["h"]
