"""Priorities and fair batches in broker mode, on real processes: a worker takes the highest
priority first and a level's tenants in turn, whichever front end their requests came
through; a level's queue timeout refuses (429 ``shed``) what waited past it, unrun."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from app.tenancy import key_hash
from tests.answers import error_of
from tests.broker import RedisServer, Workers, broker_env, lane_entries
from tests.conftest import SlowModels, distinct_images
from tests.server import ServerProcess

pytestmark = pytest.mark.slow

BATCH_S = 0.3  # each model call: long enough for the queue to build while one runs
KEYS = {"a": "key-a", "b": "key-b", "h": "key-h"}


def keys_file(folder: Path) -> Path:
    """Tenants a and b at priority 2, h at priority 1; equal weights; metrics for all."""
    path = folder / "keys.yaml"
    entries = [
        {"sha256": key_hash(key), "tenant": tenant, "scopes": ["infer"],
         "priority": 1 if tenant == "h" else 2}
        for tenant, key in KEYS.items()
    ]  # fmt: skip
    anonymous = {"tenant": "public", "scopes": ["metrics"]}
    path.write_text(json.dumps({"keys": entries, "anonymous": anonymous}))  # YAML's superset
    return path


async def send(
    client: httpx.AsyncClient,
    base_url: str,
    tenant: str,
    image: bytes,
    log: list[tuple[str, float]],
) -> httpx.Response:
    response = await client.post(
        f"{base_url}/predict/tag",
        files={"image": ("x.png", image)},
        headers={"Authorization": f"Bearer {KEYS[tenant]}"},
    )
    log.append((tenant, time.monotonic()))
    return response


def watch_landing(
    redis_server: RedisServer, counts: dict[str, int], stop: threading.Event
) -> list[float]:
    """Start a thread that notes (in the list returned) when every tenant's lanes of /tag
    have been given ``counts``' entries: from then on the workers may take them."""
    landed: list[float] = []

    def watch() -> None:
        while not stop.is_set():
            if all(lane_entries(redis_server, "tag", t) >= n for t, n in counts.items()):
                landed.append(time.monotonic())
                return
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()
    return landed


async def test_the_higher_priority_goes_first_and_tenants_share_across_front_ends(
    slow_models: SlowModels, tmp_path: Path
) -> None:
    """a floods 40 requests through one front end (10 batches of 4); b sends 4 and h 2
    through the other a moment later. First come, first served, both would wait for all of
    a's; here h's join the next batch, and b's share a's batches half and half.

    The batches are counted from the moment b's and h's entries are in Redis, not from when
    the test sent them: on a busy host their way through the other front end can take
    longer than a batch."""
    slow = slow_models(BATCH_S)
    env = {"MB_KEYS_FILE": str(keys_file(tmp_path)), "MB_PRIORITY_LEVELS": "2"}
    images = distinct_images(46)
    stop = threading.Event()
    with RedisServer() as redis_server, Workers(redis_server, slow, MB_BATCH_SIZE="4"):
        settings = broker_env(redis_server.url, slow, MB_BATCH_SIZE="4", **env)
        with ServerProcess(**settings) as one, ServerProcess(**settings) as two:
            finished: list[tuple[str, float]] = []
            async with httpx.AsyncClient(timeout=60) as client:
                flood = [send(client, one.base_url, "a", images[i], finished) for i in range(40)]
                flooding = asyncio.gather(*flood)
                await asyncio.sleep(2 * BATCH_S)  # a's first batch runs, the rest waits
                landing = watch_landing(redis_server, {"b": 4, "h": 2}, stop)
                others = [
                    send(client, two.base_url, "b", images[40 + i], finished) for i in range(4)
                ]
                others += [
                    send(client, two.base_url, "h", images[44 + i], finished) for i in range(2)
                ]
                try:
                    answers = await asyncio.gather(flooding, asyncio.gather(*others))
                finally:
                    stop.set()
            # The workers' heartbeats carry each tenant's waits; the front end's next look
            # reads them (on a busy host, a few seconds).
            expected = [
                f'microbatch_tenant_queue_wait_seconds_count{{tenant="{tenant}"}} {count}.0'
                for tenant, count in (("a", 40), ("b", 4), ("h", 2))
            ]
            deadline = time.monotonic() + 20
            while True:
                metrics = httpx.get(f"{two.base_url}/metrics", timeout=10).text
                if all(line in metrics for line in expected) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
    assert all(r.status_code == 200 for group in answers for r in group), [
        r.text for group in answers for r in group if r.status_code != 200
    ]
    assert landing, "b's and h's entries never showed in Redis"
    landed = landing[0]
    order = [f"{tenant}{t - landed:+.2f}" for tenant, t in finished]
    a_after = [t for tenant, t in finished if tenant == "a" and t > landed]
    h_done = max(t for tenant, t in finished if tenant == "h")
    b_done = max(t for tenant, t in finished if tenant == "b")
    assert len(a_after) >= 20, order  # a's backlog was still there when b's and h's came
    # h's two run in the first batch read after they came. Before it: the batch running
    # then, and the one its worker had read ahead if they came in its last moments (a's in
    # h's batch end with them). First come, first served: all of a's 20 or more.
    assert sum(t < h_done - BATCH_S / 2 for t in a_after) <= 8, order
    # b's four in turn with a's: the two batches above, h's (2 more places), then batches
    # of 2 + 2 until b's are done: at most 8 + 2 + 4 of a's.
    assert sum(t < b_done - BATCH_S / 2 for t in a_after) <= 14, order
    assert h_done - landed < 3 * BATCH_S + 1.0, order
    # Each tenant's queue wait, timed by the workers in its lane, shows on any front end.
    assert [line for line in expected if line not in metrics] == []


async def test_a_level_s_queue_timeout_refuses_what_waited_past_it_unrun(
    slow_models: SlowModels, tmp_path: Path
) -> None:
    slow = slow_models(BATCH_S)
    levels = json.dumps([{}, {"timeout_s": 2 * BATCH_S}])
    env = {"MB_KEYS_FILE": str(keys_file(tmp_path)), "MB_PRIORITY_LEVELS": levels}
    images = distinct_images(16)
    with RedisServer() as redis_server, Workers(redis_server, slow, MB_BATCH_SIZE="2") as workers:
        settings = broker_env(redis_server.url, slow, MB_BATCH_SIZE="2", **env)
        with ServerProcess(**settings) as front:
            finished: list[tuple[str, float]] = []
            async with httpx.AsyncClient(timeout=60) as client:
                answers = await asyncio.gather(
                    *(send(client, front.base_url, "a", image, finished) for image in images)
                )
            # The workers' next heartbeats carry their counts (a few seconds on a busy host).
            deadline = time.monotonic() + 20
            while True:
                live = workers.live().values()
                ran = sum(int(info["items"]) for info in live)
                shed_by_workers = sum(int(info["shed"]) for info in live)
                if ran + shed_by_workers >= len(images) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
    codes = [r.status_code for r in answers]
    shed = [r for r in answers if r.status_code == 429]
    assert set(codes) == {200, 429}, codes
    assert codes.count(200) <= 8, codes  # at most about 2 x BATCH_S of batches of 2
    for response in shed:
        assert error_of(response)["type"] == "shed"
        assert int(response.headers["Retry-After"]) >= 1
    messages = {error_of(response)["message"] for response in shed}
    assert shed_by_workers == len(shed) and ran == codes.count(200), messages  # refused unrun
