"""Priorities and fair batches in broker mode, on real processes: a worker takes the highest
priority first and a level's tenants in turn, whichever front end their requests came
through; a level's queue timeout refuses (429 ``shed``) what waited past it, unrun."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from app.tenancy import key_hash
from tests.answers import error_of
from tests.broker import RedisServer, Workers, broker_env
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


async def test_the_higher_priority_goes_first_and_tenants_share_across_front_ends(
    slow_models: SlowModels, tmp_path: Path
) -> None:
    """a floods 24 requests through one front end (6 batches of 4); b sends 4 and h 2
    through the other a moment later. First come, first served, both would wait for all of
    a's; here h's join the next batch, and b's share a's batches half and half."""
    slow = slow_models(BATCH_S)
    env = {"MB_KEYS_FILE": str(keys_file(tmp_path)), "MB_PRIORITY_LEVELS": "2"}
    images = distinct_images(30)
    with RedisServer() as redis_server, Workers(redis_server, slow, MB_BATCH_SIZE="4"):
        settings = broker_env(redis_server.url, slow, MB_BATCH_SIZE="4", **env)
        with ServerProcess(**settings) as one, ServerProcess(**settings) as two:
            finished: list[tuple[str, float]] = []
            async with httpx.AsyncClient(timeout=60) as client:
                flood = [send(client, one.base_url, "a", images[i], finished) for i in range(24)]
                flooding = asyncio.gather(*flood)
                await asyncio.sleep(2 * BATCH_S)  # a's first batch runs, the rest waits
                b_sent = time.monotonic()
                others = [
                    send(client, two.base_url, "b", images[24 + i], finished) for i in range(4)
                ]
                others += [
                    send(client, two.base_url, "h", images[28 + i], finished) for i in range(2)
                ]
                answers = await asyncio.gather(flooding, asyncio.gather(*others))
            # The workers' heartbeats carry each tenant's waits; the front end's next look
            # reads them (on a busy host, a few seconds).
            expected = [
                f'microbatch_tenant_queue_wait_seconds_count{{tenant="{tenant}"}} {count}.0'
                for tenant, count in (("a", 24), ("b", 4), ("h", 2))
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
    order = [f"{tenant}{t - b_sent:+.2f}" for tenant, t in finished]
    a_after = [t for tenant, t in finished if tenant == "a" and t > b_sent]
    h_done = max(t for tenant, t in finished if tenant == "h")
    b_done = max(t for tenant, t in finished if tenant == "b")
    assert len(a_after) >= 12, order  # a's backlog was still there when b and h came
    # h's two run in the first batch formed after they came: only the batch running then
    # (4 of a's) ends before theirs (a's in their own batch end with them).
    assert sum(t < h_done - BATCH_S / 2 for t in a_after) <= 4, order
    # b's four in turn with a's: within 4 batches of 4 (the one running, h's, two of 2 + 2).
    assert sum(t < b_done - BATCH_S / 2 for t in a_after) <= 12, order
    assert h_done - b_sent < 4 * BATCH_S + 1.0, order
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
