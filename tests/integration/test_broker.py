"""Broker mode for real: redis-server, front ends and model workers as separate processes on
127.0.0.1. Every request gets exactly one answer, its own, through any front end; batches
form in the workers across front ends; failures of workers, front ends and Redis itself
end in typed answers, never hangs, and leave nothing behind in Redis."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import pickle
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from app.manifest import read_manifest
from app.workers.allocator import jemalloc_library
from bench.loadgen import Response, closed_loop, multipart_request
from tests.answers import error_of
from tests.broker import (
    OUTLASTS_A_HEARTBEAT_S,
    PREFIX,
    RedisServer,
    Workers,
    broker_env,
    recovery_s,
    stream_key,
    stream_state,
)
from tests.checks import Expectation, mixed_jobs
from tests.children import dies_with_run, group_guard, start
from tests.conftest import SlowModels, distinct_images, normalised_pixels
from tests.models import POISON_RGB, TINY_DIM, TinyEmbedding, export_test_model
from tests.server import ServerProcess, on_jemalloc
from tests.waiting import wait_for

pytestmark = pytest.mark.slow


def front_end(redis_server: RedisServer, store: Path, **env: str) -> ServerProcess:
    return ServerProcess(**broker_env(redis_server.url, store, **env))


def png(rgb: tuple[int, int, int], size: int = 40) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(buffer, format="PNG")
    return buffer.getvalue()


def sizes_run(workers: Workers, task: str) -> Counter[int]:
    """Batches of each size the live workers ran for ``task``, of any model (from their
    heartbeats: served id -> task -> size -> batches)."""
    total: Counter[int] = Counter()
    for info in workers.live().values():
        for tasks in info.get("sizes", {}).values():
            for size, count in (tasks.get(task) or {}).items():
                total[int(size)] += count
    return total


def total(workers: Workers, field: str) -> int:
    return sum(int(info.get(field, 0)) for info in workers.live().values())


async def post(base_url: str, path: str, data: bytes, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        return await client.post(path, files={"image": ("x.png", data)}, **kwargs)


@pytest.fixture(scope="module")
def cluster(tiny_store: Path) -> Iterator[tuple[RedisServer, Workers, list[ServerProcess]]]:
    """Redis, two workers and two front ends, with a max latency no request should ever
    wait out."""
    with RedisServer() as redis_server:
        with Workers(redis_server, tiny_store, count=2, MB_MAX_LATENCY="5") as workers:
            fronts = [front_end(redis_server, tiny_store, MB_MAX_LATENCY="5") for _ in range(2)]
            try:
                for front in fronts:
                    front.start()
                yield redis_server, workers, fronts
            finally:
                for front in fronts:
                    if front.process is not None and front.process.poll() is None:
                        front.stop()


async def test_a_thousand_requests_through_two_front_ends_each_get_their_own_answer(
    cluster: tuple[RedisServer, Workers, list[ServerProcess]], tiny_store: Path
) -> None:
    redis_server, workers, fronts = cluster
    expect = Expectation(tiny_store)
    jobs = mixed_jobs(distinct_images(1000, size=40))
    answers: dict[int, list[tuple[int, Any]]] = {}
    mixed_before, items_before = total(workers, "mixed_batches"), total(workers, "items")

    async def through(front: ServerProcess, indices: list[int]) -> Any:
        requests = [
            multipart_request(
                "127.0.0.1", front.port, f"/predict/{jobs[i][0]}", jobs[i][1], fields=[("k", "3")]
            )
            for i in indices
        ]

        def record(position: int, response: Response) -> None:
            answers.setdefault(indices[position], []).append(
                (response.status, json.loads(response.body))
            )

        return await closed_loop(
            "127.0.0.1", front.port, requests, clients=32, total=len(indices), check=record
        )

    started = time.monotonic()
    halves = [[i for i in range(1000) if (i // 2) % 2 == half] for half in (0, 1)]  # both tasks
    results = await asyncio.gather(through(fronts[0], halves[0]), through(fronts[1], halves[1]))
    seconds = time.monotonic() - started
    await wait_for(
        lambda: total(workers, "items") - items_before >= 1000, what="the heartbeats to catch up"
    )
    statuses = Counter(status for replies in answers.values() for status, _ in replies)
    mismatches = [
        i for i, [(_, body)] in answers.items() if not expect.check(jobs[i][0], jobs[i][1], body)
    ]
    sizes = sizes_run(workers, "tag") + sizes_run(workers, "embedding")
    mixed = total(workers, "mixed_batches") - mixed_before
    print(
        f"\nbroker mix-up: 1000 requests through 2 front ends in {seconds:.1f} s "
        f"({1000 / seconds:.0f}/s), statuses {dict(statuses)}, mismatches {len(mismatches)}, "
        f"batches holding both front ends' items {mixed}, largest batch {max(sizes)}"
    )
    assert all(result.errors == 0 for result in results)
    assert sorted(answers) == list(range(1000))  # none missing
    assert all(len(replies) == 1 for replies in answers.values())  # none twice
    assert statuses == {200: 1000}
    assert mismatches == []
    assert mixed >= 1, "no worker batch held items from both front ends"
    assert max(sizes) > 1
    assert stream_state(redis_server) == {"tag": (0, 0), "embedding": (0, 0)}
    if jemalloc_library() is not None:  # the supervisor starts its workers on it
        pids = [info["pid"] for info in workers.live().values()]
        assert all(on_jemalloc(pid) for pid in pids)


async def test_a_lone_request_runs_at_once_as_a_batch_of_one(
    cluster: tuple[RedisServer, Workers, list[ServerProcess]], tiny_store: Path
) -> None:
    _, workers, fronts = cluster
    answered_by = workers.now_ms()  # every earlier request has had its answer
    await wait_for(lambda: workers.beat_since(answered_by), what="heartbeats holding them all")
    before = sizes_run(workers, "embedding")
    started = time.monotonic()
    response = await post(fronts[0].base_url, "/predict/embedding", distinct_images(1)[0])
    took = time.monotonic() - started
    assert response.status_code == 200
    assert took < 3.0, f"a lone request took {took:.2f} s (MB_MAX_LATENCY is 5 s)"
    await wait_for(
        lambda: sizes_run(workers, "embedding")[1] == before[1] + 1, what="the batch of 1"
    )
    assert sum(sizes_run(workers, "embedding").values()) == sum(before.values()) + 1
    print(f"\nbroker lone request: {1000 * took:.1f} ms, a batch of 1")


def images_run(workers: Workers, task: str) -> int:
    """Images the live workers ran through the model for ``task`` (from their heartbeats)."""
    return sum(size * count for size, count in sizes_run(workers, task).items())


def entries_added(redis_server: RedisServer, store: Path, task: str) -> int:
    """Requests ever added to ``task``'s stream (Redis 7's count, exact at once)."""
    info = redis_server.client().xinfo_stream(stream_key(store, task))
    return int(info["entries-added"])


async def test_v2_infer_runs_each_image_once_for_both_outputs_and_answers_as_rest_does(
    cluster: tuple[RedisServer, Workers, list[ServerProcess]], tiny_store: Path
) -> None:
    redis_server, workers, fronts = cluster
    images = distinct_images(3, size=40)
    tasks = ("embedding", "tag", "embedding_and_tag")
    added = {task: entries_added(redis_server, tiny_store, task) for task in tasks}
    ran = images_run(workers, "embedding_and_tag")
    body = {
        "inputs": [
            {
                "name": "image",
                "datatype": "BYTES",
                "shape": [3],
                "data": [base64.b64encode(image).decode() for image in images],
            }
        ],
        "outputs": [{"name": "embedding"}, {"name": "top_k_indices"}, {"name": "top_k_probs"}],
        "parameters": {"k": 3},
    }
    async with httpx.AsyncClient(base_url=fronts[0].base_url, timeout=60) as client:
        response = await client.post("/v2/models/tiny-test/infer", json=body)
    assert response.status_code == 200, response.text
    # One request per image, on the combined task's stream only, and run as such.
    assert {
        task: entries_added(redis_server, tiny_store, task) - added[task] for task in tasks
    } == {"embedding": 0, "tag": 0, "embedding_and_tag": 3}
    await wait_for(
        lambda: images_run(workers, "embedding_and_tag") - ran >= 3,
        what="the heartbeats to show the combined batches",
    )
    assert images_run(workers, "embedding_and_tag") - ran == 3
    outputs = {output["name"]: output["data"] for output in response.json()["outputs"]}
    embeddings = np.array(outputs["embedding"], dtype=np.float32).reshape(3, -1)
    indices = np.array(outputs["top_k_indices"]).reshape(3, 3)
    probs = np.array(outputs["top_k_probs"]).reshape(3, 3)
    classes = httpx.get(f"{fronts[1].base_url}/tags", timeout=5).json()
    for row, image in enumerate(images):  # through the other front end, one task at a time
        vector = await post(fronts[1].base_url, "/predict/embedding", image)
        np.testing.assert_allclose(embeddings[row], vector.json(), rtol=1e-6, atol=1e-6)
        tags = (await post(fronts[1].base_url, "/predict/tag?k=3", image)).json()
        assert [classes[index] for index in indices[row]] == [tag["name"] for tag in tags]
        np.testing.assert_allclose(probs[row], [tag["prob"] for tag in tags], atol=1e-6)
    assert redis_server.client().xlen(stream_key(tiny_store, "embedding_and_tag")) == 0


async def test_forged_entries_and_replies_are_dropped_and_nothing_crashes(
    cluster: tuple[RedisServer, Workers, list[ServerProcess]], tiny_store: Path
) -> None:
    redis_server, workers, fronts = cluster
    client = redis_server.client()
    stream = stream_key(tiny_store, "tag")
    good_header = {"v": 1, "id": "forged-1", "fe": "nobody", "task": "tag", "k": 3, "ttl_ms": 9000}
    forged = [
        {"h": pickle.dumps({"v": 1, "id": "x"}), "img": b"x"},  # pickled bytes
        {"h": json.dumps(good_header)},  # no image
        {"img": png((1, 2, 3))},  # no header
        {"h": json.dumps({**good_header, "k": "3"}), "img": png((1, 2, 3))},  # k not an int
        {"h": json.dumps({**good_header, "task": "embedding"}), "img": png((1, 2, 3))},
        {"h": json.dumps({**good_header, "id": "../../etc"}), "img": png((1, 2, 3))},
        {"h": json.dumps(good_header), "img": b"\0" * (10 * 1024 * 1024 + 1)},  # oversized
        {"h": b"\xff" * 5000, "img": b""},  # not even text
        {"h": json.dumps(good_header), "img": png((1, 2, 3)), "extra": b"1"},
        {"h": b"[" * 2000 + b"]" * 2000, "img": b"x"},  # nested past Python's stack
    ]
    malformed_before = total(workers, "malformed")
    for fields in forged:
        client.xadd(stream, fields)  # type: ignore[arg-type]
    # Forged replies, pushed at a front end: found by sending it a real request first.
    assert (
        await post(fronts[0].base_url, "/predict/tag", distinct_images(1)[0])
    ).status_code == 200
    for raw in (
        b"R1" + (5).to_bytes(4, "big") + b"nope!",
        pickle.dumps({"id": "x"}),
        b"R1"
        + (60).to_bytes(4, "big")
        + json.dumps({"id": "x", "batch": 1, "arrays": [["embedding", "|O", [1]]]}).encode()[:60],
        b"R1"
        + (len(b'{"id":"x","batch":1,"error":["SystemExit","bye"]}')).to_bytes(4, "big")
        + b'{"id":"x","batch":1,"error":["SystemExit","bye"]}',
    ):
        for key in client.scan_iter(f"{PREFIX}:replies:*"):
            client.rpush(key, raw)
    # A forged heartbeat: front ends must not believe it, nor choke on it.
    client.zadd(f"{PREFIX}:{{w}}:workers", {"forged:0": 99999999999999})
    client.hset(f"{PREFIX}:{{w}}:worker-info", "forged:0", '{"name": "forged:0", "items": "abc"}')
    await wait_for(
        lambda: total(workers, "malformed") - malformed_before == len(forged),
        what="every forged entry to be dropped",
    )
    assert stream_state(redis_server)["tag"] == (0, 0)  # acknowledged and deleted, never run
    # Every front end must have looked at Redis since the forged heartbeat: new work, then
    # wait until each front end's /info shows heartbeats written after it.
    forged_by = workers.now_ms()
    for front in fronts:
        assert (
            await post(front.base_url, "/predict/tag", distinct_images(1)[0])
        ).status_code == 200
    await wait_for(lambda: workers.beat_since(forged_by), what="heartbeats after the forgery")
    real = {name: info for name, info in workers.live().items() if name != "forged:0"}
    items = sum(int(info["items"]) for info in real.values())

    def front_end_saw(front: ServerProcess) -> bool:
        described = httpx.get(f"{front.base_url}/info", timeout=5).json()["workers"]
        return sum(int(w["items"]) for w in described if w["name"] != "forged:0") >= items

    for front in fronts:
        await wait_for(lambda front=front: front_end_saw(front), what="a monitor round")
    for front in fronts:
        described = {
            w["name"] for w in httpx.get(f"{front.base_url}/info", timeout=5).json()["workers"]
        }
        assert "forged:0" not in described and len(described) == 2
        assert httpx.get(f"{front.base_url}/metrics", timeout=5).status_code == 200
    client.zrem(f"{PREFIX}:{{w}}:workers", "forged:0")
    client.hdel(f"{PREFIX}:{{w}}:worker-info", "forged:0")
    for front in fronts:
        response = await post(front.base_url, "/predict/tag", distinct_images(2)[1])
        assert response.status_code == 200, response.text
        assert front.process is not None and front.process.poll() is None


async def test_a_front_end_killed_mid_request_leaves_the_other_serving_and_redis_bounded(
    slow_models: SlowModels,
) -> None:
    # The worker is paused (as if busy) from before the 4 requests until after the kill, so
    # that none is answered before it, however slow the host.
    slow = slow_models(0.25)
    with RedisServer() as redis_server, Workers(redis_server, slow, count=1) as workers:
        doomed, survivor = front_end(redis_server, slow), front_end(redis_server, slow)
        with doomed, survivor:
            images = distinct_images(6)
            (worker,) = workers.live().values()
            with workers.paused(worker):
                in_flight = [
                    asyncio.create_task(post(doomed.base_url, "/predict/embedding", image))
                    for image in images[:4]
                ]
                await wait_for(
                    lambda: stream_state(redis_server)["embedding"][0] >= 4, what="queued"
                )
                os.kill(doomed.pid, signal.SIGKILL)
                results = await asyncio.gather(*in_flight, return_exceptions=True)
            assert all(isinstance(r, httpx.TransportError) for r in results)
            response = await post(survivor.base_url, "/predict/embedding", images[5])
            assert response.status_code == 200
            # The dead front end's requests were answered into its reply list, which expires.
            client = redis_server.client()
            await wait_for(lambda: stream_state(redis_server)["embedding"] == (0, 0), what="done")
            lists = list(client.scan_iter(f"{PREFIX}:replies:*"))
            assert lists, "the dead front end's replies should be waiting to expire"
            assert all(0 < client.ttl(key) <= 60 for key in lists)


async def test_a_corrupt_image_fails_alone_in_its_batch(slow_models: SlowModels) -> None:
    # Each batch outlasts a heartbeat, so that one shows the blocker running, and the other
    # uploads queue behind it.
    slow = slow_models(OUTLASTS_A_HEARTBEAT_S)
    expect = Expectation(slow)
    with RedisServer() as redis_server, Workers(redis_server, slow, count=1) as workers:
        with front_end(redis_server, slow) as front:
            images = distinct_images(5)
            await post(front.base_url, "/predict/embedding", images[0])  # learns its batch time
            blocker = asyncio.create_task(post(front.base_url, "/predict/embedding", images[0]))
            await wait_for(
                lambda: any(w.get("running") for w in workers.live().values()), what="busy"
            )
            uploads = [images[1], images[2][:200], images[3], images[4]]
            answers = await asyncio.gather(
                blocker, *(post(front.base_url, "/predict/embedding", data) for data in uploads)
            )
    assert [a.status_code for a in answers] == [200, 200, 400, 200, 200]
    assert error_of(answers[2])["type"] == "invalid_image"
    for answer, data in zip(answers[1:], uploads, strict=True):
        if answer.status_code == 200:
            assert expect.check("embedding", data, answer.json())


async def test_a_worker_killed_mid_batch_has_its_entries_answered_exactly_once(
    slow_models: SlowModels,
) -> None:
    # Each batch outlasts a heartbeat, so that one shows a worker running its batch, and the
    # kill lands in the middle of it.
    slow = slow_models(OUTLASTS_A_HEARTBEAT_S)
    expect = Expectation(slow)
    images = distinct_images(8)
    # The victim's entries (all 8 at most) are answered within `worst` of the kill. Their
    # deadline leaves 10 s more for what comes before the kill (a batch and a heartbeat),
    # so that a slow recovery fails the assertion below, not at the deadline.
    worst = recovery_s(OUTLASTS_A_HEARTBEAT_S, len(images))
    with RedisServer() as redis_server, Workers(redis_server, slow, count=2) as workers:
        with front_end(redis_server, slow, MB_REQUEST_TIMEOUT=f"{worst + 10:.1f}") as front:
            await post(front.base_url, "/predict/embedding", images[0])
            requests = [
                asyncio.create_task(post(front.base_url, "/predict/embedding", image))
                for image in images
            ]

            def busy() -> dict[str, Any] | None:
                running = [w for w in workers.live().values() if w.get("running", 0) >= 2]
                return running[0] if running else None

            await wait_for(lambda: busy() is not None, what="a worker running a batch")
            victim = busy()
            assert victim is not None
            os.kill(victim["pid"], signal.SIGKILL)
            killed = time.monotonic()
            answers = await asyncio.gather(*requests)
            recovered = time.monotonic() - killed
            await wait_for(
                lambda: stream_state(redis_server) == {"tag": (0, 0), "embedding": (0, 0)},
                what="nothing left in Redis",
            )
            await wait_for(
                lambda: any(w.get("restarts") == 1 for w in workers.live().values()),
                what="the killed worker back",
            )
    print(
        f"\nbroker kill -9 of a worker holding {victim['running']} items: all "
        f"{len(answers)} answered {recovered:.1f} s after the kill (at most {worst:.1f} s)"
    )
    assert [a.status_code for a in answers] == [200] * len(images)
    for answer, image in zip(answers, images, strict=True):
        assert expect.check("embedding", image, answer.json())
    assert recovered < worst


async def test_a_poison_input_that_kills_its_worker_fails_alone_after_max_deliveries(
    tiny_store: Path,
) -> None:
    # Two workers: the poison kills one, then the other (its second delivery), and whichever
    # is back first fails it. One alone would have to be back within STALE_S + ORPHANED_S of
    # its death each time (a restart is a new process importing torch), or the front end fails
    # what waits on it (503 worker_died), as it should; found by CI on a busy host.
    expect = Expectation(tiny_store)
    poison = png(POISON_RGB)
    goods = distinct_images(3)
    command = [sys.executable, str(Path(__file__).parents[1] / "poison_worker.py")]
    with RedisServer() as redis_server:
        with Workers(redis_server, tiny_store, count=2, command=command, MB_MAX_DELIVERIES="2"):
            with front_end(redis_server, tiny_store) as front:
                started = time.monotonic()
                answers = await asyncio.gather(
                    post(front.base_url, "/predict/embedding", poison),
                    *(post(front.base_url, "/predict/embedding", data) for data in goods),
                )
                took = time.monotonic() - started
                await wait_for(
                    lambda: stream_state(redis_server)["embedding"] == (0, 0), what="empty"
                )
    print(f"\nbroker poison: answered in {took:.1f} s, statuses {[a.status_code for a in answers]}")
    assert answers[0].status_code == 500
    assert error_of(answers[0])["type"] == "inference_error"
    assert [a.status_code for a in answers[1:]] == [200, 200, 200]
    for answer, data in zip(answers[1:], goods, strict=True):
        assert expect.check("embedding", data, answer.json())


async def test_redis_stopped_under_load_gives_fast_503s_then_recovers_by_itself(
    tiny_store: Path,
) -> None:
    with RedisServer() as redis_server, Workers(redis_server, tiny_store, count=1) as workers:
        with front_end(redis_server, tiny_store) as front:
            pids = (front.pid, workers.process.pid if workers.process else 0)
            image = distinct_images(1)[0]
            assert (await post(front.base_url, "/predict/tag", image)).status_code == 200
            redis_server.stop()
            outage: list[tuple[int, float, str]] = []
            async with httpx.AsyncClient(base_url=front.base_url, timeout=30) as client:
                for _ in range(20):
                    began = time.monotonic()
                    response = await client.post("/predict/tag", files={"image": ("x", image)})
                    kind = error_of(response)["type"] if response.status_code != 200 else ""
                    outage.append((response.status_code, time.monotonic() - began, kind))
                    await asyncio.sleep(0.05)
                ready = await client.get("/readyz")
                redis_server.start()  # empty: streams and consumer group are gone
                began = time.monotonic()
                while True:
                    response = await client.post("/predict/tag", files={"image": ("x", image)})
                    if response.status_code == 200:
                        break
                    assert time.monotonic() - began < 20, response.text
                    await asyncio.sleep(0.2)
                back_after = time.monotonic() - began
            assert (front.pid, workers.process.pid if workers.process else 0) == pids
            assert front.process is not None and front.process.poll() is None
    statuses = Counter(status for status, _, _ in outage)
    slowest = max(seconds for _, seconds, _ in outage)
    print(
        f"\nbroker outage: {dict(statuses)} while Redis was down, slowest answer "
        f"{1000 * slowest:.0f} ms; served again {back_after:.1f} s after Redis came back"
    )
    assert statuses == {503: 20}
    assert {kind for _, _, kind in outage} == {"broker_unavailable"}
    assert slowest < 1.5  # not its socket timeout (2 s) or more
    assert ready.status_code == 503


async def test_no_worker_alive_gives_fast_503s_and_readiness_503(tiny_store: Path) -> None:
    with RedisServer() as redis_server, Workers(redis_server, tiny_store, count=1) as workers:
        with front_end(redis_server, tiny_store) as front:
            workers.stop()
            await wait_for(lambda: front.readiness()[0] == 503, what="readiness 503")
            began = time.monotonic()
            response = await post(front.base_url, "/predict/embedding", distinct_images(1)[0])
            assert time.monotonic() - began < 1.5  # at once: ORPHANED_S (2 s) or more is not
    assert response.status_code == 503
    assert error_of(response)["type"] == "worker_died"
    assert "Retry-After" in response.headers


async def test_a_request_past_its_deadline_is_never_run(tiny_store: Path) -> None:
    """Its front end deletes the entry when its caller gives up; an entry that reaches a
    worker after its deadline anyway (by Redis's clock) is dropped unrun. The worker is
    paused (SIGSTOP) meanwhile, as if busy."""
    from app.broker.wire.request import encode_request
    from app.jobs import Task

    with RedisServer() as redis_server, Workers(redis_server, tiny_store, count=1) as workers:
        with front_end(redis_server, tiny_store) as front:
            images = distinct_images(2)
            assert (await post(front.base_url, "/predict/embedding", images[0])).status_code == 200
            await wait_for(lambda: total(workers, "items") == 1, what="the heartbeat")
            (worker,) = workers.live().values()
            with workers.paused(worker):
                late = await post(
                    front.base_url,
                    "/predict/embedding",
                    images[1],
                    headers={"X-Request-Timeout": "0.2"},
                )
                await wait_for(
                    lambda: stream_state(redis_server)["embedding"][0] == 0,
                    what="its front end to delete the entry",
                )
                # One no front end takes back: 1 ms to live.
                fields = encode_request("x-1", "nobody", Task.EMBEDDING, 0, 1, images[1])
                stream = stream_key(tiny_store, "embedding")
                redis_server.client().xadd(stream, fields)  # type: ignore[arg-type]
                await asyncio.sleep(0.05)  # well past its deadline when the worker wakes
            # The paused worker may have had the late entry delivered while it blocked on
            # its read; by Redis's clock both are past their deadline when it wakes.
            await wait_for(lambda: total(workers, "expired") >= 1, what="the late entry dropped")
            await wait_for(
                lambda: stream_state(redis_server)["embedding"] == (0, 0), what="nothing left"
            )
            assert total(workers, "items") == 1  # neither of them ever ran
    assert late.status_code == 504


def add_ghost_worker(redis_server: RedisServer, *, draining: bool = False) -> None:
    """A worker that seems alive to the front ends (a fresh heartbeat for export
    ``0`` * 12) and never reads its stream; ``draining``: told to stop."""
    info = {
        "name": "ghost:0", "host": "ghost", "index": 0, "pid": 1, "device": "cpu",
        "threads": 1, "batch_size": 8, "ready": True, "alive": True, "running": 0,
        "restarts": 0, "batches": 0, "items": 0, "mixed_batches": 0, "expired": 0,
        "malformed": 0, "reclaimed": 0, "given_up": 0,
        "models": [{"name": "ghost", "version": 1, "served_id": GHOST_ID, "state": "ready"}],
        "draining": draining,
    }  # fmt: skip
    client = redis_server.client()
    client.zadd(f"{PREFIX}:{{w}}:workers", {"ghost:0": 99999999999999})
    client.hset(f"{PREFIX}:{{w}}:worker-info", "ghost:0", json.dumps(info))


GHOST_ID = "ghost@" + "0" * 12
GHOST_STREAM = f"{PREFIX}:{{q}}:{'0' * 12}:embedding"


@pytest.mark.parametrize("leaves", ["waiting", "while-added"])
async def test_a_caller_that_leaves_takes_its_entry_out_of_the_stream(leaves: str) -> None:
    """The Streamer cancels a batch whose callers all left; the broker transport then deletes
    the entry, so a worker that has not read it yet never computes it: also when the caller
    leaves after Redis added the entry but before its answer (the id) came back."""
    from app.batching import BatchItem
    from app.broker.front.transport import BrokerTransport
    from app.jobs import BatchKey, ImageJob, Task

    with RedisServer() as redis_server:
        client = redis_server.client()
        add_ghost_worker(redis_server)
        transport = BrokerTransport(redis_server.url, PREFIX, max_queue=16)
        await transport.start()
        try:
            assert transport.ready
            answered = asyncio.Event()
            if leaves == "while-added":
                admit = transport._admit

                async def answered_late(**kwargs: Any) -> Any:
                    added = await admit(**kwargs)
                    await answered.wait()  # the answer reaches the front end after the cancel
                    return added

                transport._admit = answered_late
            item = BatchItem(1, ImageJob(b"upload", top_k=0), time.monotonic() + 30)
            waiting = asyncio.create_task(
                transport.run_batch(BatchKey(Task.EMBEDDING, True, GHOST_ID), [item])
            )
            await wait_for(lambda: client.xlen(GHOST_STREAM) == 1, what="added")
            waiting.cancel()
            await asyncio.sleep(0)
            answered.set()
            await wait_for(lambda: client.xlen(GHOST_STREAM) == 0, what="deleted")
        finally:
            await transport.aclose()


async def test_a_front_end_that_stops_takes_its_waiting_entries_out_of_the_stream() -> None:
    """At shutdown the requests still waiting are answered 503 (``not_ready``), and their
    entries leave the streams before the clients close: no worker computes them."""
    from app.batching import BatchItem
    from app.broker.front.transport import BrokerTransport
    from app.errors import NotReady
    from app.jobs import BatchKey, ImageJob, Task

    with RedisServer() as redis_server:
        client = redis_server.client()
        add_ghost_worker(redis_server)
        transport = BrokerTransport(redis_server.url, PREFIX, max_queue=16)
        await transport.start()
        items = [BatchItem(i, ImageJob(b"upload", top_k=0), time.monotonic() + 30) for i in (1, 2)]
        waiting = [
            asyncio.create_task(
                transport.run_batch(BatchKey(Task.EMBEDDING, True, GHOST_ID), [item])
            )
            for item in items
        ]
        await wait_for(lambda: client.xlen(GHOST_STREAM) == 2, what="added")
        await transport.aclose()
        assert client.xlen(GHOST_STREAM) == 0
        for task in waiting:
            (answer,) = (await task).values()
            assert isinstance(answer, NotReady)


async def test_a_front_end_that_saw_no_worker_looks_again_before_refusing() -> None:
    """A worker that started after the front end's last look (up to a second ago) serves the
    next request: the front end looks at Redis itself before it answers ``worker_died``."""
    from app.batching import BatchItem
    from app.broker.front.transport import BrokerTransport
    from app.jobs import BatchKey, ImageJob, Task

    with RedisServer() as redis_server:
        client = redis_server.client()
        transport = BrokerTransport(redis_server.url, PREFIX, max_queue=16)
        await transport.start()
        try:
            assert not transport.ready  # its first look saw no worker
            add_ghost_worker(redis_server)  # the monitor's next look is a second away
            item = BatchItem(1, ImageJob(b"upload", top_k=0), time.monotonic() + 30)
            waiting = asyncio.create_task(
                transport.run_batch(BatchKey(Task.EMBEDDING, True, GHOST_ID), [item])
            )
            await wait_for(lambda: client.xlen(GHOST_STREAM) == 1 or waiting.done(), what="added")
            assert not waiting.done(), waiting.exception()
            assert transport.ready and client.xlen(GHOST_STREAM) == 1
            waiting.cancel()
        finally:
            await transport.aclose()


async def test_a_new_request_for_a_version_only_a_stopping_worker_holds_is_refused_at_once() -> (
    None
):
    """A worker told to stop (draining) finishes what it holds and takes nothing new, and
    readiness stops counting it: a new request for the version only it holds is refused
    503 ``worker_died`` at once, and adds nothing to the stream. (Found by CI: the request
    was queued, and failed ``ORPHANED_S`` later, once the worker had gone.)"""
    from app.batching import BatchItem
    from app.broker.front.transport import BrokerTransport
    from app.errors import WorkerDied
    from app.jobs import BatchKey, ImageJob, Task

    with RedisServer() as redis_server:
        client = redis_server.client()
        add_ghost_worker(redis_server, draining=True)
        transport = BrokerTransport(redis_server.url, PREFIX, max_queue=16)
        await transport.start()
        try:
            assert transport.monitor.workers, "the front end saw the stopping worker"
            item = BatchItem(1, ImageJob(b"upload", top_k=0), time.monotonic() + 30)
            with pytest.raises(WorkerDied):
                await asyncio.wait_for(
                    transport.run_batch(BatchKey(Task.EMBEDDING, True, GHOST_ID), [item]), 10
                )
            assert client.xlen(GHOST_STREAM) == 0
        finally:
            await transport.aclose()


@pytest.mark.parametrize("launcher", ["uvicorn", "gunicorn"])
async def test_several_front_end_processes_share_one_port_and_one_metrics(
    launcher: str, tiny_store: Path, tmp_path: Path
) -> None:
    """The two documented launches of N front-end processes: all of them serve, and a
    scrape of any one counts every process's requests (prometheus multiprocess mode)."""
    from tests.server import REPO, free_port

    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    port, grpc_port = free_port(), free_port()
    commands = {
        "uvicorn": ["-m", "uvicorn", "--factory", "app.main:create_app", "--workers", "2"],
        "gunicorn": ["-m", "gunicorn", "-k", "app.gunicorn_worker.Worker", "-w", "2"],
    }
    bind = ["--host", "127.0.0.1", "--port", str(port)]
    if launcher == "gunicorn":
        bind = ["-b", f"127.0.0.1:{port}", "app.main:create_app()"]
    with RedisServer() as redis_server, Workers(redis_server, tiny_store, count=1):
        env = {
            **os.environ,
            **broker_env(
                redis_server.url,
                tiny_store,
                PROMETHEUS_MULTIPROC_DIR=str(metrics_dir),
                MB_GRPC_PORT=str(grpc_port),  # every process serves it, on one port
            ),
        }
        import subprocess

        log_path = tmp_path / "front-ends.log"
        with log_path.open("wb") as log:
            process = start(
                [sys.executable, *commands[launcher], *bind], own_group=True, cwd=REPO,
                env=env, stdout=subprocess.DEVNULL, stderr=log,
            )  # fmt: skip
        # uvicorn's workers do not watch their parent: their group dies whole with the run.
        with group_guard(process):
            try:
                base = f"http://127.0.0.1:{port}"
                await wait_for(
                    lambda: _ready(base) or process.poll() is not None, timeout_s=60, what="ready"
                )
                assert process.poll() is None, log_path.read_text()
                # A new connection per request, until both processes have served some (the
                # second may still be starting when the first answers /readyz).
                close = [("Connection", "close")]
                requests = [
                    multipart_request("127.0.0.1", port, "/predict/embedding", data, headers=close)
                    for data in distinct_images(50)
                ]
                statuses: Counter[int] = Counter()
                deadline = time.monotonic() + 60
                route = "/predict/embedding"
                while len(_pids(metrics_dir, route)) < 2 and time.monotonic() < deadline:
                    result = await closed_loop("127.0.0.1", port, requests, clients=16, total=50)
                    statuses += result.statuses
                grpc_answers = [await _grpc_infer(grpc_port, data) for data in distinct_images(8)]
                metrics = httpx.get(f"{base}/metrics", timeout=10).text
            finally:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=30)
    assert [list(a.outputs[0].shape) for a in grpc_answers] == [[1, TINY_DIM]] * 8
    by_grpc = [
        line for line in metrics.splitlines()
        if line.startswith("microbatch_http_requests_total{")
        and 'route="grpc ModelInfer",status="200"' in line
    ]  # fmt: skip
    assert by_grpc and float(by_grpc[0].split()[-1]) == 8
    served = [
        line for line in metrics.splitlines()
        if line.startswith("microbatch_http_requests_total{")
        and 'route="/predict/embedding",status="200"' in line
    ]  # fmt: skip
    assert len(_pids(metrics_dir, route)) == 2, "one process served every request"
    assert set(statuses) == {200}
    assert served and float(served[0].split()[-1]) == statuses[200]  # summed over both


async def _grpc_infer(port: int, data: bytes) -> Any:
    """One v2 ModelInfer over gRPC, on a channel of its own (a new connection each time)."""
    import grpc

    from app.v2.proto import inference_pb2 as pb
    from app.v2.proto import inference_pb2_grpc as pb_grpc
    from app.v2.tensors import pack_bytes

    request = pb.ModelInferRequest(model_name="tiny-test")
    request.inputs.add(name="image", datatype="BYTES", shape=[1])
    request.outputs.add(name="embedding")
    request.raw_input_contents.append(pack_bytes([data]))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        return await pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)


def _pids(metrics_dir: Path, route: str) -> set[str]:
    """The processes that have answered `route` (prometheus writes one file per pid; a file
    alone is not enough: every process counts the /readyz polls of the start)."""
    import json

    from prometheus_client.mmap_dict import MmapedDict

    def served(path: Path) -> bool:
        return any(
            json.loads(key)[2].get("route") == route and value > 0
            for key, value, *_ in MmapedDict.read_all_values_from_file(str(path))  # type: ignore[no-untyped-call]
        )

    return {p.stem.rsplit("_", 1)[-1] for p in metrics_dir.glob("counter_*.db") if served(p)}


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_the_worker_command_refuses_to_start_without_a_broker(tiny_store: Path) -> None:
    import subprocess

    from tests.server import REPO

    env = {k: v for k, v in os.environ.items() if k != "MB_BROKER"}
    done = subprocess.run(
        [sys.executable, "-m", "app.broker.worker"],
        cwd=REPO,
        env={**env, "MODEL_STORE": str(tiny_store)},
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=dies_with_run(),
    )
    assert done.returncode == 2 and "MB_BROKER" in done.stderr
    np.testing.assert_equal(done.stdout, "")


async def test_the_one_machine_cluster_serves_and_stops_cleanly(tiny_store: Path) -> None:
    """``make run-cluster``: Redis, 2 front ends and 2 workers from one command; SIGTERM
    stops them all (front ends, then workers, then Redis) and nothing is left running."""
    import psutil

    from tests.broker import require_redis_server
    from tests.server import REPO, free_port

    require_redis_server()
    port, redis_port = free_port(), free_port()
    env = {
        **{k: v for k, v in os.environ.items() if k != "MB_BROKER"},
        "HOST": "127.0.0.1",
        "PORT": str(port),
        "MODEL_STORE": str(tiny_store),
        "CUDA_DEVICES": "cpu",
        "MB_WORKER_THREADS": "1",
        "MB_BROKER_PREFIX": PREFIX,
        "LOG_LEVEL": "warning",
    }
    command = [sys.executable, "-m", "app.broker.cluster", "--redis-port", str(redis_port)]
    process = start(command, own_group=True, cwd=REPO, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        await wait_for(lambda: _ready(base), timeout_s=90, what="the cluster to be ready")
        family = [process.pid] + [c.pid for c in psutil.Process(process.pid).children(True)]
        # Ready through one front-end process; the other may not have looked at Redis since
        # the workers came, and looks again rather than refuse.
        image = distinct_images(1)[0]
        answers = [await post(base, "/predict/embedding", image) for _ in range(4)]
        await wait_for(
            lambda: len(httpx.get(f"{base}/readyz", timeout=5).json()["workers"]) == 2,
            what="both workers seen",
        )
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=90)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert [a.status_code for a in answers] == [200] * 4, answers[-1].text
    assert code == 0

    def left_running() -> list[int]:
        running = []
        for pid in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    running.append(pid)
        return running

    # The command has exited; its children are reaped by now or within moments.
    await wait_for(lambda: left_running() == [], timeout_s=10, what="every process to exit")


async def test_the_shared_queue_bound_holds_across_front_ends(tiny_store: Path) -> None:
    """MB_MAX_QUEUE counts what waits in Redis, whichever front end added it: with the only
    worker paused (as if busy), two front ends can add 4 entries in all, and the rest get 503
    queue_full with Retry-After at once, not once room is made."""
    with RedisServer() as redis_server, Workers(redis_server, tiny_store, count=1) as workers:
        fronts = [front_end(redis_server, tiny_store, MB_MAX_QUEUE="4") for _ in range(2)]
        with fronts[0], fronts[1]:
            images = distinct_images(12)
            for front, image in zip(fronts, images[10:], strict=True):  # each front end warm
                assert (await post(front.base_url, "/predict/embedding", image)).status_code == 200
            await wait_for(lambda: stream_state(redis_server)["embedding"][0] == 0, what="empty")
            (worker,) = workers.live().values()
            with workers.paused(worker):
                requests = [
                    asyncio.create_task(post(fronts[i % 2].base_url, "/predict/embedding", image))
                    for i, image in enumerate(images[:4])
                ]
                await wait_for(lambda: stream_state(redis_server)["embedding"][0] == 4, what="4")
                started = time.monotonic()
                refused = [
                    await post(fronts[i % 2].base_url, "/predict/embedding", image)
                    for i, image in enumerate(images[4:10])
                ]
                took = time.monotonic() - started
            answered = await asyncio.gather(*requests)
    assert [r.status_code for r in refused] == [503] * 6
    assert {error_of(r)["type"] for r in refused} == {"queue_full"}
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert took < 5.0  # each at once: one waiting for room would wait out its deadline (30 s)
    assert [r.status_code for r in answered] == [200] * 4


async def test_front_ends_never_reach_workers_of_another_export(
    tiny_store: Path, tmp_path: Path
) -> None:
    """Vectors of two exports never mix: a front end whose repository holds another export
    than the workers serve routes nothing to them (their streams are their export's own):
    its model has no version ready, and its requests are refused, never answered by the
    other export."""
    other = export_test_model(tmp_path / "other", TinyEmbedding(), arch="other-test")
    with RedisServer() as redis_server, Workers(redis_server, other, count=1):
        front = front_end(redis_server, tiny_store).start(ready=False)
        try:
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:  # it never becomes ready
                status, body = front.readiness()
                assert status == 503, body
                time.sleep(0.2)
            answer = httpx.post(
                f"{front.base_url}/predict/embedding",
                files={"image": ("a.png", distinct_images(1)[0])},
                timeout=10,
            )
        finally:
            front.stop()
    held = [m["served_id"] for worker in body["workers"] for m in worker["models"]]
    assert status == 503 and held == [read_manifest(other).served_id("auto")]
    assert answer.status_code == 503 and error_of(answer)["type"] == "not_ready"


async def test_preprocessed_pixels_travel_the_broker_and_answer_as_their_images(
    cluster: tuple[RedisServer, Workers, list[ServerProcess]], tiny_store: Path
) -> None:
    """A v2 client's FP32 input crosses Redis as uint8 pixels, beside encoded uploads, and
    answers what the same images answer as uploads."""
    redis_server, _, fronts = cluster
    images = distinct_images(3, size=40)
    tensor = normalised_pixels(tiny_store, images)
    body = {
        "inputs": [
            {
                "name": "pixels",
                "datatype": "FP32",
                "shape": list(tensor.shape),
                "data": tensor.ravel().tolist(),
            }
        ],
        "outputs": [{"name": "embedding"}],
    }
    async with httpx.AsyncClient(base_url=fronts[0].base_url, timeout=60) as client:
        uploads = [post(fronts[1].base_url, "/predict/embedding", image) for image in images]
        answered, *vectors = await asyncio.gather(
            client.post("/v2/models/tiny-test/infer", json=body), *uploads
        )
    assert answered.status_code == 200, answered.text
    rows = np.array(answered.json()["outputs"][0]["data"], np.float32).reshape(3, -1)
    for row, vector in zip(rows, vectors, strict=True):
        np.testing.assert_allclose(row, vector.json(), rtol=1e-5, atol=1e-5)
    assert redis_server.client().xlen(stream_key(tiny_store, "embedding")) == 0
