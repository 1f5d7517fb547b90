"""Priorities and fair batches in broker mode, on a real Redis: the front end's admission
script (lanes, their description, the doorbell, each level's bound) and a worker's reads
(the highest level first, a level's tenants in turn by weight, a level's ``max_batch``, the
wake-up of a blocking read), with the code both sides run."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import redis

from app.batching import LevelPolicy, Ticket
from app.broker.front.admission import ADMIT
from app.broker.front.transport import BrokerTransport
from app.broker.wire.keys import GROUP, Keys
from app.broker.wire.lanes import Lane, decode_lane, encode_lane
from app.broker.wire.parsing import MalformedMessage, text
from app.broker.wire.request import decode_request, encode_request
from app.broker.worker.entries import fields_of, past_level_wait
from app.broker.worker.lanes import LaneReader, is_doorbell
from app.errors import QueueFull, Shed
from app.jobs import Task
from tests.broker import RedisServer

SERVED = "m@89e9be0d4f64"
KEYS = Keys("mb")
TASK_STREAM = KEYS.stream(SERVED, Task.TAG)


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    with RedisServer() as server:
        yield server.client()


class FrontEnd:
    """A front end's admission, as ``BrokerTransport`` makes it, without its reply reader."""

    def __init__(self, client: redis.Redis, levels: Sequence[LevelPolicy], max_queue: int):
        self.transport = BrokerTransport(
            "redis://unused", "mb", max_queue=max_queue, levels=levels, tenant_lanes=True
        )
        self.admit = client.register_script(ADMIT)
        self.sent = 0

    def look(self, client: redis.Redis) -> None:
        """The lanes its monitor would see at its next look (every second)."""
        names = map(text, client.hkeys(KEYS.lanes(SERVED)))
        self.transport.monitor.lanes = {SERVED: KEYS.lanes_of(SERVED, names)}

    def send(self, tenant: str | None, level: int, weight: float = 1.0) -> Any:
        """Admit one request; its entry id, or the transport's refusal."""
        ticket = Ticket(tenant, level, weight)
        stream, lane = self.transport.admission.lane(SERVED, Task.TAG, ticket)
        self.sent += 1
        name = f"{tenant}-{level}-{self.sent}"
        fields = encode_request(name, "fe", Task.TAG, 1, 60_000, b"image")
        keys, args = self.transport.admission.request(SERVED, Task.TAG, stream, lane, fields)
        added = self.admit(keys=keys, args=args)
        return added if isinstance(added, bytes) else self.transport.admission.refusal(added, lane)


def worker(client: redis.Redis) -> LaneReader:
    def ensure(streams: Sequence[str]) -> None:
        for stream in streams:
            try:
                client.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                assert "BUSYGROUP" in str(exc)

    ensure([TASK_STREAM])
    return LaneReader(client, KEYS, "w1", ensure)


def take(reader: LaneReader, size: int) -> list[str]:
    """One read of a worker whose model takes ``size``: the requests' names, in order
    (doorbells as ``bell``)."""
    read = reader.read({TASK_STREAM: (SERVED, Task.TAG)}, {SERVED: size})
    names = []
    for _, entries in read or []:
        for _, fields in fields_of(entries):
            names.append("bell" if is_doorbell(fields) else decode_request(fields, 100).id)
    return names


def tenants(names: list[str]) -> Counter[str]:
    return Counter(name.split("-")[0] for name in names if name != "bell")


def test_the_highest_level_goes_first_and_a_level_s_tenants_share_by_weight(
    client: redis.Redis,
) -> None:
    front = FrontEnd(client, [LevelPolicy(), LevelPolicy()], max_queue=100)
    reader = worker(client)
    for _ in range(24):
        front.send("shop", 1, weight=3.0)
    for _ in range(12):
        front.send("bulk", 1)
    front.send(None, 0)
    front.send(None, 0)
    # Each new lane is described once, and rung in its task's stream once.
    lanes: dict[bytes, bytes] = client.hgetall(KEYS.lanes(SERVED))  # type: ignore[assignment]
    described = {text(k): decode_lane(v) for k, v in lanes.items()}
    assert described == {
        f"{TASK_STREAM}:p2:shop": Lane(Task.TAG, level=1, weight=3.0),
        f"{TASK_STREAM}:p2:bulk": Lane(Task.TAG, level=1, weight=1.0),
    }
    reader.refresh([SERVED])
    assert sorted(reader.known) == sorted(described)

    first = take(reader, 8)
    assert first[:4] == ["bell", "bell", "None-0-37", "None-0-38"]  # level 1 waits
    # Then fills what is left (a doorbell takes no place): shop's turn first, 3, 1, then 2.
    assert tenants(first[4:]) == {"shop": 5, "bulk": 1}
    for _ in range(3):  # 3:1 in every batch, whichever tenant's turn comes first
        assert tenants(take(reader, 8)) == {"shop": 6, "bulk": 2}
    front.send(None, 0)
    after = take(reader, 8)  # shop has 1 left, bulk 5: bulk goes on alone
    assert after[0] == "None-0-39" and tenants(after[1:]) == {"shop": 1, "bulk": 5}
    assert take(reader, 8) == []  # nothing left: a blocking read, and nothing came


def test_a_level_s_max_batch_keeps_its_share_of_a_batch_short(client: redis.Redis) -> None:
    front = FrontEnd(client, [LevelPolicy(), LevelPolicy(max_batch=3)], max_queue=100)
    reader = worker(client)
    for _ in range(10):
        front.send("bulk", 1)
    reader.refresh([SERVED])
    assert take(reader, 8) == ["bell", "bulk-1-1", "bulk-1-2", "bulk-1-3"]  # 3, no more
    assert len(take(reader, 8)) == 3
    front.send(None, 0)
    batch = take(reader, 8)
    assert batch[0] == "None-0-11" and len(batch) == 3


def test_a_level_s_max_batch_holds_whichever_of_its_lanes_turns_first(client: redis.Redis) -> None:
    # Level 0 holds the task's own stream (no tenant, no policy written) beside a tenant's
    # lane: the level's bound is its policy's, not the first lane's of this batch's turn.
    front = FrontEnd(client, [LevelPolicy(max_batch=3)], max_queue=100)
    reader = worker(client)
    for _ in range(8):
        front.send("shop", 0)
        front.send(None, 0)
    reader.refresh([SERVED])
    sizes = [len([n for n in take(reader, 8) if n != "bell"]) for _ in range(4)]
    assert sizes == [3, 3, 3, 3]


def test_a_lone_request_in_a_lane_wakes_a_blocked_worker_at_once(client: redis.Redis) -> None:
    front = FrontEnd(client, [LevelPolicy(), LevelPolicy()], max_queue=100)
    reader = worker(client)
    front.send("bulk", 1)
    reader.refresh([SERVED])
    assert take(reader, 8) == ["bell", "bulk-1-1"]
    read: list[list[str]] = []
    blocked = threading.Thread(target=lambda: read.append(take(reader, 8)))
    started = time.monotonic()
    blocked.start()
    time.sleep(0.2)
    sent = time.monotonic()
    front.send("bulk", 1)
    blocked.join(timeout=5)
    assert read == [["bulk-1-2"]]
    # Woken by the entry, not by the end of the 1 s block (at least 0.8 s after the send).
    assert time.monotonic() - sent < 0.6, time.monotonic() - started


def test_each_level_s_bound_and_a_full_queue_refuse_the_lower_levels_with_429(
    client: redis.Redis,
) -> None:
    front = FrontEnd(client, [LevelPolicy(), LevelPolicy(max_queue=3)], max_queue=6)
    assert all(isinstance(front.send("bulk", 1), bytes) for _ in range(3))
    shed = front.send("bulk", 1)
    assert isinstance(shed, Shed) and "priority 2 is full (3 waiting)" in shed.message
    # The doorbell is in the task's stream: 4 entries held. Two more fill the queue.
    assert all(isinstance(front.send(None, 0), bytes) for _ in range(2))
    front.look(client)  # bulk's lane is counted once the front end knows it
    full_low, full_high = front.send("shop", 1), front.send(None, 0)
    assert isinstance(full_low, Shed) and "higher priorities come first" in full_low.message
    assert isinstance(full_high, QueueFull)


def test_forged_lanes_are_never_read(client: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    reader = worker(client)
    client.set("mb:other", "a string, not a stream")
    good = encode_lane(Lane(Task.TAG, level=1))
    client.hset(
        KEYS.lanes(SERVED),
        mapping={
            "mb:other": good,  # not a lane of this version
            "mb:{q}:ffffffffffff:tag:p2:x": good,  # another version's
            f"{TASK_STREAM}:p2:x": b"{not json",
            f"{TASK_STREAM}:p3:y": good,  # says level 1, named level 2
            f"{TASK_STREAM}:p2:z": json.dumps({"task": "tag", "level": 1, "weight": -1}),
            f"{TASK_STREAM}:p2:ok": good,
        },
    )
    reader.refresh([SERVED])
    assert list(reader.known) == [f"{TASK_STREAM}:p2:ok"]
    assert caplog.text.count("ignored lane") == 3
    assert take(reader, 8) == []


@pytest.mark.parametrize(
    "raw",
    [
        b"[]",
        json.dumps({"task": "nope", "level": 0, "weight": 1, "reject": True}).encode(),
        json.dumps({"task": "tag", "level": True, "weight": 1, "reject": True}).encode(),
        json.dumps({"task": "tag", "level": 0, "weight": 1e9, "reject": True}).encode(),
        json.dumps({"task": "tag", "level": 0, "weight": 1, "reject": "yes"}).encode(),
        json.dumps(
            {"task": "tag", "level": 0, "weight": 1, "reject": True, "max_batch": 0}
        ).encode(),
    ],
)
def test_a_malformed_lane_is_refused(raw: bytes) -> None:
    with pytest.raises(MalformedMessage):
        decode_lane(raw)


def test_lane_names_keep_the_task_stream_for_the_highest_level_without_a_tenant() -> None:
    assert KEYS.lane(SERVED, Task.TAG, 0, None) == TASK_STREAM
    for level, tenant in ((0, "shop"), (1, None), (2, "a.b-c_d")):
        lane = KEYS.lane(SERVED, Task.TAG, level, tenant)
        assert KEYS.base(lane) == TASK_STREAM and KEYS.lane_level(lane) == level
        assert KEYS.lanes_of(SERVED, [lane, TASK_STREAM]) == (lane,)


def test_without_a_keys_file_the_callers_of_a_level_share_its_lane() -> None:
    """A regression: API_KEY's tenant (``default``) and the anonymous callers got lanes of
    their own, so a server without keys or levels no longer used its task streams."""
    plain = BrokerTransport("redis://unused", "mb", max_queue=8)
    assert plain.admission.lane(SERVED, Task.TAG, Ticket("default", 0)) == (TASK_STREAM, None)
    levels = BrokerTransport("redis://unused", "mb", max_queue=8, levels=[LevelPolicy()] * 2)
    stream, lane = levels.admission.lane(SERVED, Task.TAG, Ticket("anonymous", 1))
    assert stream == f"{TASK_STREAM}:p2" and lane == Lane(Task.TAG, level=1)


def test_the_highest_level_s_policy_holds_for_callers_without_a_tenant(
    client: redis.Redis,
) -> None:
    """A regression: the highest level's callers without a tenant waited in the task's
    stream, whose description no worker reads, so that level's ``timeout_s`` and
    ``max_batch`` held in one process and not in broker mode."""
    policy = LevelPolicy(timeout_s=0.05, max_batch=2)
    front = FrontEnd(client, [policy, LevelPolicy()], max_queue=100)
    stream, lane = front.transport.admission.lane(SERVED, Task.TAG, Ticket(None, 0))
    assert stream == f"{TASK_STREAM}:p1" and KEYS.lane_level(stream) == 0
    assert lane == Lane(Task.TAG, level=0, max_batch=2, timeout_ms=50)
    reader = worker(client)
    for _ in range(3):
        assert isinstance(front.send(None, 0), bytes)
    reader.refresh([SERVED])
    assert sorted(take(reader, 8)) == ["None-0-1", "None-0-2", "bell"]  # 2: its max_batch
    time.sleep(0.1)
    read = reader.read({TASK_STREAM: (SERVED, Task.TAG)}, {SERVED: 8})
    [(name, [(entry_id, _)])] = [(text(s), e) for s, e in read]
    shed = past_level_wait(reader.lane(name), entry_id, int(time.time() * 1000))
    assert isinstance(shed, Shed) and "priority 1 waits at most 0.05 s" in shed.message


def test_a_live_worker_s_pending_lane_entries_are_its_own() -> None:
    """A regression: a worker's pending entries in a lane were taken for orphans (its
    heartbeat named the version's task streams, not its lanes), so another worker would
    claim and run them again while it computed them."""
    from types import SimpleNamespace

    from app.broker.wire.live import LiveView
    from app.broker.worker.orphans import OrphanClaims

    held = SimpleNamespace(served_id=SERVED)
    info = SimpleNamespace(name="w2", models=[held], holds=lambda served_id: served_id == SERVED)
    view = LiveView(0, frozenset({"w2"}), (info,))  # type: ignore[arg-type]
    claims = OrphanClaims.__new__(OrphanClaims)
    claims.keys = KEYS
    lane = KEYS.lane(SERVED, Task.TAG, 1, "shop")
    assert claims._reads(view, "w2", lane) and claims._reads(view, "w2", TASK_STREAM)
    assert not claims._reads(view, "w2", KEYS.lane("m@ffffffffffff", Task.TAG, 1, "shop"))


async def test_the_backlog_an_autoscaler_reads_counts_the_lanes(client: redis.Redis) -> None:
    import redis.asyncio as aioredis

    from app.broker.front.backlog import count_backlog

    front = FrontEnd(client, [LevelPolicy(), LevelPolicy()], max_queue=100)
    for tenant, level in (("shop", 1), ("bulk", 1), (None, 0), (None, 1)):
        front.send(tenant, level)
    reader = worker(client)
    reader.refresh([SERVED])  # the lanes' groups, as a worker makes them
    taken = take(reader, 2)  # read, not answered: pending, not lag
    url = f"redis://127.0.0.1:{client.connection_pool.connection_kwargs['port']}/0"
    async with aioredis.from_url(url) as async_client:
        backlog = await count_backlog(async_client, KEYS, [SERVED])
    # 4 requests and 3 doorbells (the lanes of shop, bulk and priority 2 without a tenant).
    assert (backlog.lag + backlog.pending, backlog.pending) == (7, len(taken))
    assert tenants(taken) and backlog.lag > 0
    assert {count.stream for count in backlog.streams} >= set(reader.known)
