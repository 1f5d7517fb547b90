"""How a broker worker reads the lanes (``app.broker.wire.lanes``): which exist, and a batch
taken from them highest level first and, within a level, from the tenants in turn, weighted.

* **One script call a batch** (``TAKE``): for each version and task the worker reads, it
  takes up to the model's batch size: the levels in order, each only while the batch holds
  fewer than its ``max_batch``; within a level, round after round, each lane gives as many
  entries as its weight says (its weight over the level's least, rounded, at least one)
  until the batch is full or the level has nothing more. The first lane of each level turns
  with every batch, so no tenant always goes first. Fair across front ends: the entries of a
  tenant, from every front end, wait in one lane.
* **Nothing waiting: one blocking read** of every stream and lane (one entry of each at
  most), which returns the moment one entry exists, as a worker without lanes reads: a
  lone request still runs at once.
* **Which lanes exist**: the versions' lanes hashes, read every round and at once when a
  front end's doorbell (an entry naming a new lane in its task's stream) comes.

Each worker takes its batches this way; a worker does not wait for another's to be fair,
so with several workers the shares hold per batch, not per instant.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import redis

from app.broker.wire.keys import GROUP, Keys
from app.broker.wire.lanes import Lane, decode_lane
from app.broker.wire.parsing import MalformedMessage, text
from app.jobs import Task

log = logging.getLogger("app.worker")

DOORBELL = b"lane"  # the field of a doorbell entry (its value: the new lane's stream)
# ARGV: [1] the group, [2] the consumer, [3] G groups; then per group its batch size and how
# many lanes (KEYS, in order: level by level, each level's in this batch's turn); then per
# lane its level, its share of a round and its level's max_batch (0: none). Returns
# {stream, entries} pairs, as XREADGROUP does (a lane may come more than once); a doorbell
# entry is returned, and takes no place in the batch.
TAKE = """
local group, consumer, groups = ARGV[1], ARGV[2], tonumber(ARGV[3])
local at = 4 + 2 * groups
local out = {}
local first = 1
for g = 1, groups do
  local want, count = tonumber(ARGV[2 + 2 * g]), tonumber(ARGV[3 + 2 * g])
  local last = first + count - 1
  local taken, i = 0, first
  while i <= last and taken < want do
    local level, j = ARGV[at + 3 * (i - 1)], i
    while j < last and ARGV[at + 3 * j] == level do j = j + 1 end
    local limit = want
    local cap = tonumber(ARGV[at + 3 * (i - 1) + 2])
    if cap > 0 and cap < limit then limit = cap end
    local live = {}
    for k = i, j do live[#live + 1] = k end
    while taken < limit and #live > 0 do
      local still = {}
      for _, k in ipairs(live) do
        if taken < limit then
          local n = math.min(tonumber(ARGV[at + 3 * (k - 1) + 1]), limit - taken)
          local got = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n,
                                 'STREAMS', KEYS[k], '>')
          if got then
            local entries = got[1][2]
            out[#out + 1] = {KEYS[k], entries}
            for _, entry in ipairs(entries) do  -- a doorbell takes no place in the batch
              if entry[2][1] ~= 'lane' then taken = taken + 1 end
            end
            if #entries == n then still[#still + 1] = k end
          end
        end
      end
      live = still
    end
    i = j + 1
  end
  first = last + 1
end
return out
"""


class LaneReader:
    """The lanes of the versions one worker holds, and its reads of them.

    >>> # lanes = LaneReader(client, Keys("mb"), "host-1:0", ensure_groups)
    >>> # lanes.refresh(["m@89e9be0d4f64"])
    >>> # lanes.read({"mb:{q}:89e9be0d4f64:tag": ("m@89e9be0d4f64", Task.TAG)}, {...: 32})
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        consumer: str,
        ensure_groups: Callable[[Sequence[str]], None],
    ) -> None:
        self.client = client
        self.keys = keys
        self.consumer = consumer
        self._ensure_groups = ensure_groups
        self._take = client.register_script(TAKE)
        # Lane stream -> (served id, what it holds): one assignment per refresh (the
        # fetcher thread reads it whole).
        self.known: dict[str, tuple[str, Lane]] = {}
        self._turn = 0
        self._malformed: set[str] = set()  # logged once each

    def of(self, served_ids: Iterable[str]) -> list[str]:
        """The lanes of ``served_ids`` known now."""
        wanted = set(served_ids)
        return [stream for stream, (served_id, _) in self.known.items() if served_id in wanted]

    def lane(self, stream: str) -> Lane | None:
        """What a lane holds; None for a task's own stream (or a lane not known now)."""
        known = self.known.get(stream)
        return None if known is None else known[1]

    def refresh(self, served_ids: Iterable[str]) -> None:
        """Read the lanes hashes of ``served_ids`` (the versions held); a new lane's group
        is made before it is read. Raises ``RedisError`` or ``OSError``."""
        versions = sorted(set(served_ids))
        with self.client.pipeline(transaction=False) as pipe:
            for served_id in versions:
                pipe.hgetall(self.keys.lanes(served_id))
            described = pipe.execute()
        known: dict[str, tuple[str, Lane]] = {}
        for served_id, lanes in zip(versions, described, strict=True):
            named = {text(name): raw for name, raw in lanes.items()}
            for stream in self.keys.lanes_of(served_id, named):
                try:
                    lane = decode_lane(named[stream])
                    task_stream = self.keys.stream(served_id, lane.task)
                    if (self.keys.base(stream), self.keys.lane_level(stream)) != (
                        task_stream,
                        lane.level,
                    ):
                        raise MalformedMessage("its name and what it holds differ")
                except MalformedMessage as exc:
                    if stream not in self._malformed:
                        self._malformed.add(stream)
                        log.error("worker %s: ignored lane %s: %s", self.consumer, stream, exc)
                    continue
                known[stream] = (served_id, lane)
        new = [stream for stream in known if stream not in self.known]
        if new:
            self._ensure_groups(new)
        self.known = known

    def read(self, streams: Mapping[str, tuple[str, Task]], batch_sizes: Mapping[str, int]) -> Any:
        """The next batch of every version and task in ``streams`` (a task's stream ->
        its served id and task), ``batch_sizes`` (served id -> its model's) at most each:
        taken (``take``), or, with nothing waiting, what a blocking read of every stream
        and lane gives first. As ``XREADGROUP`` answers: None, or [stream, entries] pairs."""
        taken = self.take(streams, batch_sizes)
        if taken:
            return taken
        every: dict[Any, Any] = {
            name: ">"
            for stream, (served_id, _) in streams.items()
            if served_id in batch_sizes
            for name in [stream, *(lane for lane, _ in self._lanes_of(stream))]
        }
        if not every:
            return None
        return self.client.xreadgroup(GROUP, self.consumer, every, count=1, block=1000)

    def _lanes_of(self, stream: str) -> list[tuple[str, Lane]]:
        """The lanes of a task's stream known now, and what each holds."""
        return [
            (name, lane) for name, (_, lane) in self.known.items() if self.keys.base(name) == stream
        ]

    def take(self, streams: Mapping[str, tuple[str, Task]], batch_sizes: Mapping[str, int]) -> Any:
        """``read``'s batch of what waits now (``TAKE``), without blocking; None if nothing
        waits."""
        keys: list[str] = []
        groups: list[int] = []
        lanes: list[Any] = []
        self._turn += 1
        for stream, (served_id, task) in streams.items():
            size = batch_sizes.get(served_id)
            if size is None:
                continue
            ordered = self._in_turn([(stream, Lane(task)), *self._lanes_of(stream)])
            groups += [size, len(ordered)]
            caps = self._caps(ordered)
            for name, lane in ordered:
                keys.append(name)
                lanes += [lane.level, self._share(lane, ordered), caps.get(lane.level, 0)]
        if not keys:
            return None
        return (
            self._take(keys=keys, args=[GROUP, self.consumer, len(groups) // 2, *groups, *lanes])
            or None
        )

    def _in_turn(self, lanes: list[tuple[str, Lane]]) -> list[tuple[str, Lane]]:
        """``lanes`` level by level; each level's (by name) turned by this batch's number."""
        ordered: list[tuple[str, Lane]] = []
        for level in sorted({lane.level for _, lane in lanes}):
            same = sorted((pair for pair in lanes if pair[1].level == level), key=lambda p: p[0])
            turn = self._turn % len(same)
            ordered += same[turn:] + same[:turn]
        return ordered

    @staticmethod
    def _caps(lanes: list[tuple[str, Lane]]) -> dict[int, int]:
        """Each level's ``max_batch``, whichever of its lanes says it (the task's own stream
        says none: its level's policy is written only in its tenants' lanes)."""
        caps: dict[int, int] = {}
        for _, lane in lanes:
            if lane.max_batch:
                caps[lane.level] = min(lane.max_batch, caps.get(lane.level, lane.max_batch))
        return caps

    @staticmethod
    def _share(lane: Lane, lanes: list[tuple[str, Lane]]) -> int:
        """Entries ``lane`` gives a round: its weight over its level's least, at least 1."""
        least = min(other.weight for _, other in lanes if other.level == lane.level)
        return max(1, min(1 << 16, round(lane.weight / least)))


def is_doorbell(fields: Mapping[bytes, bytes]) -> bool:
    """Whether an entry is a front end's doorbell (a new lane), not a request."""
    return DOORBELL in fields
