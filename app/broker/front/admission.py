"""A broker front end's admission: which stream (lane) a request waits in, the one script
that bounds the shared queue and each priority level and adds the request to it, and what a
refused caller hears.

Without a keys file or priority levels every request goes to its task's stream, as it always
did; with them, each level and tenant waits in a lane of its own (``app.broker.wire.lanes``),
which the workers read in their order (``app.broker.worker.lanes``). The bounds hold across
every front end: the script counts what waits in Redis, every routed version's streams and
the lanes this front end's monitor has seen (``Monitor.counted``; a lane another front end
made, from the next look).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.batching import LevelPolicy, Ticket
from app.broker.front.monitor import Monitor
from app.broker.front.waiting import LaneNote
from app.broker.wire.keys import Keys
from app.broker.wire.lanes import Lane, encode_lane
from app.broker.wire.parsing import text
from app.errors import QueueFull, ServerError, Shed
from app.jobs import Task

# Add one request to KEYS[ARGV[1]] unless the streams counted (KEYS but the last when ARGV[7]
# describes a lane: every routed version's streams and lanes, its level's first ARGV[5])
# already hold ARGV[2] entries (those waiting and those being computed), or its level's
# ARGV[6] (0: no bound of its own): one round trip, and the bounds hold across every front
# end. A lane the version's lanes hash (the last key) did not list yet is described there, and
# a doorbell entry in KEYS[ARGV[8]] (its task's stream, which every worker holding the
# version reads) tells a worker to read it.
ADMIT = """
local counted = #KEYS
if ARGV[7] ~= '' then counted = counted - 1 end
local held, level = 0, 0
for i = 1, counted do
  local n = redis.call('XLEN', KEYS[i])
  held = held + n
  if i <= tonumber(ARGV[5]) then level = level + n end
end
if held >= tonumber(ARGV[2]) then return {'full', held} end
local bound = tonumber(ARGV[6])
if bound > 0 and level >= bound then return {'level', level} end
local stream = KEYS[tonumber(ARGV[1])]
local id = redis.call('XADD', stream, '*', 'h', ARGV[3], 'img', ARGV[4])
if ARGV[7] ~= '' and redis.call('HSET', KEYS[#KEYS], stream, ARGV[7]) == 1 then
  redis.call('XADD', KEYS[tonumber(ARGV[8])], '*', 'lane', stream)
end
return id
"""


class Admission:
    """One front end's admission to the shared queue.

    >>> # admission = Admission(Keys("mb"), monitor, max_queue=1024, levels=[LevelPolicy()])
    >>> # stream, lane = admission.lane("m@89e9be0d4f64", Task.TAG, ticket)
    >>> # keys, args = admission.request("m@89e9be0d4f64", Task.TAG, stream, lane, fields)
    """

    def __init__(
        self,
        keys: Keys,
        monitor: Monitor,
        *,
        max_queue: int,
        levels: Sequence[LevelPolicy] = (LevelPolicy(),),
        tenant_lanes: bool = False,
    ) -> None:
        self.keys = keys
        self.monitor = monitor
        self.max_queue = max_queue
        self.levels = tuple(levels)  # MB_PRIORITY_LEVELS: each level's lanes and bound
        # A keys file's tenants each get a lane (without one, the callers of API_KEY and
        # the anonymous ones share their level's: nothing changes without keys or levels).
        self.tenant_lanes = tenant_lanes

    def _counted(self, served_id: str, stream: str, level: int) -> tuple[list[str], int]:
        """The streams the queue bound counts (every routed version's streams and lanes, and
        ``stream``), those of ``level`` first, and how many of them are its."""
        ids = {route.served_id for route in self.monitor.routes.values()} | {served_id}
        counted = {s for model in ids for s in self.monitor.counted(model)} | {stream}
        own = sorted(s for s in counted if self.keys.lane_level(s) == level)
        return own + sorted(counted.difference(own)), len(own)

    def lane(self, served_id: str, task: Task, ticket: Ticket) -> tuple[str, Lane | None]:
        """Where a request of ``ticket`` waits, and what its lane holds (None: its task's
        stream, the highest level without a tenant, when that level's policy has nothing
        the workers read)."""
        level = min(ticket.level, len(self.levels) - 1)
        tenant = ticket.tenant if self.tenant_lanes and isinstance(ticket.tenant, str) else None
        policy = self.levels[level]
        read = policy.timeout_s is not None or policy.max_batch is not None
        stream = self.keys.lane(served_id, task, level, tenant, own=read)
        if stream == self.keys.stream(served_id, task):
            return stream, None
        timeout_ms = None if policy.timeout_s is None else max(1, round(1000 * policy.timeout_s))
        reject = policy.on_timeout == "reject"
        return stream, Lane(task, level, ticket.weight, policy.max_batch, timeout_ms, reject)

    def request(
        self, served_id: str, task: Task, stream: str, lane: Lane | None, fields: dict[str, bytes]
    ) -> tuple[list[str], list[Any]]:
        """The admission script's keys and arguments (``ADMIT``) for a request of ``fields``
        to ``stream`` (``lane``: what it holds)."""
        level = 0 if lane is None else lane.level
        counted, own = self._counted(served_id, stream, level)
        bound = self.levels[level].max_queue or 0
        args: list[Any] = [counted.index(stream) + 1, self.max_queue, fields["h"], fields["img"]]
        args += [own, bound, b"" if lane is None else encode_lane(lane)]
        if lane is None:
            return counted, args
        doorbell = self.keys.stream(served_id, task)
        if doorbell not in counted:
            counted.append(doorbell)
        return [*counted, self.keys.lanes(served_id)], [*args, counted.index(doorbell) + 1]

    def note(self, served_id: str, task: Task, lane: Lane | None) -> LaneNote | None:
        """How the workers learn of ``lane`` (None: a task's stream), should its request be
        sent again after a failover lost it with the lane's description."""
        if lane is None:
            return None
        return LaneNote(self.keys.lanes(served_id), self.keys.stream(served_id, task),
                        encode_lane(lane))  # fmt: skip

    def refusal(self, refused: Any, lane: Lane | None) -> ServerError:
        """What the caller of a request the admission script refused hears: 503 for the
        highest level (the server is full, whoever asks); 429 ``shed`` for a level below it
        (higher priorities come first), at a full queue or at its level's own bound."""
        why, held = text(refused[0]), int(refused[1])
        retry_after_s = self.monitor.retry_after(held)
        if lane is None or lane.level == 0:
            return QueueFull(f"the shared queue is full ({held} waiting)", retry_after_s)
        if why == "full":
            message = f"the shared queue is full ({held} waiting); higher priorities come first"
        else:
            message = f"priority {lane.level + 1} is full ({held} waiting)"
        return Shed(message, retry_after_s)
