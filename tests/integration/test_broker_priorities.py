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
from tests.broker import RedisServer, Workers, broker_env, lane_entries
from tests.conftest import SlowModels, distinct_images
from tests.server import ServerProcess
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

BATCH_S = 0.3  # each model call: long enough for the queue to build while one runs
PAUSED_BATCH_S = 0.5  # each model call once all is queued: batches told apart at the client
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


async def landed(redis_server: RedisServer, tenant: str, count: int) -> None:
    """Wait until ``tenant``'s lanes of /tag have been given ``count`` entries."""
    await wait_for(lambda: lane_entries(redis_server, "tag", tenant) >= count, timeout_s=30,
                   what=f"{tenant}'s {count} entries in Redis")  # fmt: skip


async def test_the_higher_priority_goes_first_and_tenants_share_across_front_ends(
    slow_models: SlowModels, tmp_path: Path
) -> None:
    """a queues 40 requests through one front end; b 4 and h 4 through the other, after a's.
    First come, first served, both would wait for all of a's. Here h's run in the first batch
    the worker takes, all four together, and b's share the next ones with a's, half and half.

    The worker is paused (as if busy) while they queue, so the batches it then takes follow
    from its rules, not from how fast the uploads came on this host: at most one of a's runs
    first (the one its blocking read may have been handed meanwhile)."""
    slow = slow_models(PAUSED_BATCH_S)
    env = {"MB_KEYS_FILE": str(keys_file(tmp_path)), "MB_PRIORITY_LEVELS": "2"}
    images = distinct_images(51)
    with RedisServer() as redis_server, Workers(redis_server, slow, MB_BATCH_SIZE="4") as workers:
        settings = broker_env(redis_server.url, slow, MB_BATCH_SIZE="4", **env)
        with ServerProcess(**settings) as one, ServerProcess(**settings) as two:
            finished: list[tuple[str, float]] = []
            async with httpx.AsyncClient(timeout=60) as client:
                # One each first: the front ends warm, and every tenant's lane known to the
                # worker (no doorbell read beside a batch later).
                warm = [(one, "a", 48), (two, "b", 49), (two, "h", 50)]
                for front, tenant, index in warm:
                    assert (
                        await send(client, front.base_url, tenant, images[index], [])
                    ).is_success
                (worker,) = workers.live().values()
                with workers.paused(worker):
                    flood = [
                        send(client, one.base_url, "a", images[i], finished) for i in range(40)
                    ]
                    flooding = asyncio.gather(*flood)
                    await landed(redis_server, "a", 41)
                    others = [
                        send(client, two.base_url, tenant, images[40 + i], finished)
                        for i, tenant in enumerate("bbbbhhhh")
                    ]
                    answering = asyncio.gather(*others)
                    await landed(redis_server, "b", 5)
                    await landed(redis_server, "h", 5)
                answers = await asyncio.gather(flooding, answering)
            # The workers' heartbeats carry each tenant's waits; the front end's next look
            # reads them (on a busy host, a few seconds).
            expected = [
                f'microbatch_tenant_queue_wait_seconds_count{{tenant="{tenant}"}} {count}.0'
                for tenant, count in (("a", 41), ("b", 5), ("h", 5))
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
    first = min(t for _, t in finished)
    order = [f"{tenant}{t - first:+.2f}" for tenant, t in sorted(finished, key=lambda f: f[1])]
    a_done = [t for tenant, t in finished if tenant == "a"]
    h_done = max(t for tenant, t in finished if tenant == "h")
    b_done = max(t for tenant, t in finished if tenant == "b")
    # A batch's answers come back together; the next batch's PAUSED_BATCH_S later.
    # h's four run as one batch, the first (or the second, after a lone a): with h at a's
    # level, taken in turn with a and b, a's would run in h's batches, and before the last.
    assert sum(t < h_done - PAUSED_BATCH_S / 2 for t in a_done) <= 1, order
    # b's four in turn with a's: two batches of 2 + 2 after h's (in FIFO order: after a's 40).
    assert sum(t < b_done - PAUSED_BATCH_S / 2 for t in a_done) <= 3, order
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
