"""The response cache on the real app (``app.testing.FakeTransport`` behind it, counting
model calls): ``X-Cache`` on each route, ``Cache-Control: no-cache``, errors never kept,
pinned requests and rollouts never handed another export's answer, v2's outputs and ``k``
kept apart, single-flight through the batches, hits while the queue is full, the metrics."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from app.errors import BrokerUnavailable
from app.images import preprocess
from app.jobs import EmbeddingAndTopK, ImageJob, Task, TopK
from app.main import create_app
from app.manifest import read_manifest
from app.repository import publish, staging_folder
from app.settings import Settings
from app.testing import FakeTransport
from tests.conftest import distinct_images
from tests.models import export_scaled, export_tiny

IMAGES = distinct_images(3)
ADMIN = "admin-key"


def answer(task: Task, jobs: Sequence[ImageJob]) -> list[object]:
    """An embedding of each image's mean pixel (so images differ), or its top k."""
    out: list[object] = []
    for job in jobs:
        pixels = job.image if not isinstance(job.image, bytes) else None
        level = float(np.mean(pixels)) if pixels is not None else float(len(job.image))
        vector = np.full(8, level, np.float32)
        top = TopK(np.arange(job.top_k), np.full(job.top_k, 0.5, np.float32))
        both = EmbeddingAndTopK(vector, top)
        out.append(vector if task is Task.EMBEDDING else top if task is Task.TAG else both)
    return out


@asynccontextmanager
async def serving(
    tmp_path: Path, transport: FakeTransport | None = None, **settings: Any
) -> AsyncIterator[tuple[FakeTransport, httpx.AsyncClient]]:
    root = tmp_path / "models"
    export_tiny(root / "tiny" / "1")
    fake = transport or FakeTransport(answer)
    app = create_app(
        Settings(
            model_repository=root,
            admin_api_key=ADMIN,
            mb_cache_bytes=settings.pop("mb_cache_bytes", 1 << 20),
            mb_decode="server",
            **settings,
        ),
        transport=fake,
    )
    async with app.router.lifespan_context(app):
        asgi = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=asgi, base_url="http://t") as client:
            yield fake, client


def images_run(fake: FakeTransport) -> int:
    return sum(len(batch.jobs) for batch in fake.batches)


async def embed(
    client: httpx.AsyncClient, image: bytes = IMAGES[0], headers: dict[str, str] | None = None
) -> httpx.Response:
    return await client.post(
        "/predict/embedding",
        files={"image": ("x.png", image)},
        headers={"Accept": "application/octet-stream", **(headers or {})},
    )


async def test_a_repeat_is_a_hit_bit_for_bit_with_the_same_model_id(tmp_path: Path) -> None:
    async with serving(tmp_path) as (fake, client):
        miss, hit = await embed(client), await embed(client)
        assert [miss.headers["X-Cache"], hit.headers["X-Cache"]] == ["miss", "hit"]
        assert hit.content == miss.content and len(miss.content) == 32
        assert hit.headers["X-Model-Id"] == miss.headers["X-Model-Id"]
        assert images_run(fake) == 1
        fresh = await embed(client, headers={"Cache-Control": "no-cache"})
        assert fresh.headers["X-Cache"] == "miss" and images_run(fake) == 2
        other = await embed(client, IMAGES[1])
        assert other.headers["X-Cache"] == "miss" and other.content != miss.content
        # Several images: a miss if any was computed, a hit when none was.
        files = [("image", ("a.png", IMAGES[0])), ("image", ("b.png", IMAGES[1]))]
        both = await client.post("/predict/embedding", files=files)
        assert both.headers["X-Cache"] == "hit" and images_run(fake) == 3
        files.append(("image", ("c.png", IMAGES[2])))
        three = await client.post("/predict/embedding", files=files)
        assert three.headers["X-Cache"] == "miss" and images_run(fake) == 4
        # The tag routes answer from the same cache, under the key of their task and k:
        # TorchServe's route asks the top 5 of the same model, as /predict/tag does.
        sent = {"image": ("x.png", IMAGES[0])}
        tags = [await client.post("/predict/tag", files=sent) for _ in range(2)]
        assert [r.headers["X-Cache"] for r in tags] == ["miss", "hit"]
        assert tags[0].json() == tags[1].json()
        top3 = await client.post("/predict/tag", files=sent, params={"k": 3})
        assert top3.headers["X-Cache"] == "miss" and len(top3.json()) == 3
        stock = await client.post("/predictions/tiny", files=sent)
        assert stock.headers["X-Cache"] == "hit" and images_run(fake) == 6


async def test_without_the_setting_there_is_no_cache_and_no_header(tmp_path: Path) -> None:
    async with serving(tmp_path, mb_cache_bytes=0) as (fake, client):
        answers = [await embed(client) for _ in range(2)]
        assert all("X-Cache" not in a.headers for a in answers) and images_run(fake) == 2


async def test_an_error_is_never_kept(tmp_path: Path) -> None:
    async with serving(tmp_path) as (_, client):
        bad = [await embed(client, b"not an image") for _ in range(2)]
        assert [b.status_code for b in bad] == [400, 400]
        failing = FakeTransport(lambda task, jobs: [RuntimeError("boom") for _ in jobs])
    async with serving(tmp_path / "2", failing) as (_, client):
        assert [(await embed(client)).status_code for _ in range(2)] == [500, 500]
        assert len(failing.batches) == 2  # each computed again


async def test_thirty_two_identical_requests_at_once_run_one_image(tmp_path: Path) -> None:
    gate = asyncio.Event()

    async def slow(task: Task, jobs: Sequence[ImageJob]) -> list[object]:
        await gate.wait()
        return answer(task, jobs)

    fake = FakeTransport(slow)
    async with serving(tmp_path, fake) as (_, client):
        sent = [asyncio.ensure_future(embed(client)) for _ in range(32)]
        await asyncio.sleep(1.0)  # each parsed and at the cache (a few ms each on a busy host)
        gate.set()
        answers = await asyncio.gather(*sent)
        assert {a.status_code for a in answers} == {200}
        assert len({a.content for a in answers}) == 1
        said = sorted(a.headers["X-Cache"] for a in answers)
        assert said == ["coalesced"] * 31 + ["miss"]
        assert images_run(fake) == 1 and len(fake.batches) == 1
        metrics = (await client.get("/metrics")).text
        assert 'microbatch_cache_images_total{outcome="coalesced"} 31.0' in metrics
        assert 'microbatch_cache_images_total{outcome="miss"} 1.0' in metrics
        assert "microbatch_cache_entries 1.0" in metrics
        # one model call, as the batch metrics count it too
        assert 'microbatch_batch_size_sum{model="tiny",task="embedding",version="1"} 1.0' in (
            metrics
        )


async def test_a_request_waiting_on_an_identical_one_answers_504_at_its_own_deadline(
    tmp_path: Path,
) -> None:
    """``X-Request-Timeout`` holds while an identical request computes (before: it got the
    other's answer whenever that came, 3 s and more past its own 0.5 s)."""
    gate = asyncio.Event()

    async def held(task: Task, jobs: Sequence[ImageJob]) -> list[object]:
        await gate.wait()
        return answer(task, jobs)

    async with serving(tmp_path, FakeTransport(held), mb_request_timeout=10) as (_, client):
        leader = asyncio.ensure_future(embed(client))
        await asyncio.sleep(0.2)
        began = asyncio.get_running_loop().time()
        hurried = await asyncio.wait_for(embed(client, headers={"X-Request-Timeout": "0.5"}), 5)
        waited = asyncio.get_running_loop().time() - began
        assert hurried.status_code == 504 and 0.4 < waited < 2.5
        assert not leader.done()
        gate.set()
        assert (await leader).status_code == 200


async def test_a_hit_is_answered_while_the_queue_is_full(tmp_path: Path) -> None:
    gate = asyncio.Event()

    async def stuck(task: Task, jobs: Sequence[ImageJob]) -> list[object]:
        await gate.wait()
        return answer(task, jobs)

    fake = FakeTransport(stuck, batch_size=1)
    async with serving(tmp_path, fake, mb_max_queue=1, mb_request_timeout=10) as (_, client):
        gate.set()
        assert (await embed(client)).headers["X-Cache"] == "miss"
        gate.clear()
        # New images, one after another, until one finds the queue full: with the batch
        # stuck, nothing leaves the queue (for the 10 s of their timeout).
        new = iter(distinct_images(12)[3:])
        busy: list[asyncio.Future[httpx.Response]] = []
        while not any(b.done() and b.result().status_code == 503 for b in busy):
            busy.append(asyncio.ensure_future(embed(client, next(new))))
            await asyncio.sleep(0.2)
        full = await embed(client, next(new))
        assert full.status_code == 503  # a new image finds the queue full
        hit = await embed(client)
        assert hit.status_code == 200 and hit.headers["X-Cache"] == "hit"
        gate.set()
        await asyncio.gather(*busy)


def v2_body(outputs: list[str], k: int | None = None, classes: int | None = None) -> Any:
    asked = [
        {"name": name, **({"parameters": {"class_count": classes}} if classes else {})}
        for name in outputs
    ]
    image = base64.b64encode(IMAGES[0]).decode()
    inputs = [{"name": "image", "datatype": "BYTES", "shape": [1], "data": [image]}]
    return {"inputs": inputs, "outputs": asked, **({"parameters": {"k": k}} if k else {})}


async def test_v2_outputs_k_and_class_counts_never_share_an_entry(tmp_path: Path) -> None:
    asked: list[tuple[list[str], int | None, int | None]] = [
        (["embedding"], None, None),
        (["top_k_probs"], 3, None),
        (["top_k_probs"], 2, None),
        (["top_k_probs"], None, 2),
        (["embedding", "top_k_indices"], 3, None),
        (["embedding", "top_k_indices"], 2, None),
    ]
    async with serving(tmp_path) as (fake, client):
        url = "/v2/models/tiny/infer"
        firsts = [await client.post(url, json=v2_body(*a)) for a in asked]
        assert [r.status_code for r in firsts] == [200] * len(asked), firsts[0].text
        said = [r.headers["X-Cache"] for r in firsts]
        # class_count 2 asks the top 2, as k=2 does: the same answer, so the same entry
        assert said == ["miss", "miss", "miss", "hit", "miss", "miss"]
        agains = [await client.post(url, json=v2_body(*a)) for a in asked]
        assert [r.headers["X-Cache"] for r in agains] == ["hit"] * len(asked)
        for first, again in zip(firsts, agains, strict=True):
            assert first.json()["outputs"] == again.json()["outputs"]
        # An FP32 tensor (pixels the client preprocessed) is keyed by its values and shape.
        spec = read_manifest(tmp_path / "models" / "tiny" / "1").input
        levels = preprocess(IMAGES[0], spec).astype(np.float32) / 255
        mean, std = np.asarray(spec.mean, np.float32), np.asarray(spec.std, np.float32)
        pixels = ((levels - mean) / std).transpose(2, 0, 1)[None]
        tensor = {
            "name": "pixels",
            "datatype": "FP32",
            "shape": list(pixels.shape),
            "data": pixels.flatten().tolist(),
        }
        body = {"inputs": [tensor], "outputs": [{"name": "embedding"}]}
        sent = [await client.post(url, json=body) for _ in range(2)]
        assert [r.headers.get("X-Cache") for r in sent] == ["miss", "hit"], sent[0].text
        assert images_run(fake) == len(asked) - 1 + 1


async def test_a_pin_or_a_rollout_never_gets_another_export_s_answer(tmp_path: Path) -> None:
    async with serving(tmp_path) as (fake, client):
        first = await embed(client)
        v1 = first.headers["X-Model-Id"]
        staging = staging_folder(tmp_path / "models" / "tiny")
        export_scaled(staging, 2.0)
        publish(staging, tmp_path / "models" / "tiny")
        admin = {"Authorization": f"Bearer {ADMIN}"}
        load = await client.post("/v2/repository/models/tiny/load", headers=admin)
        assert load.status_code == 200, load.text
        after = await embed(client)
        v2 = after.headers["X-Model-Id"]
        assert v2 != v1 and after.headers["X-Cache"] == "miss"  # the new id: a new key
        assert (await embed(client)).headers["X-Cache"] == "hit"
        # Roll back: v1 serves again, and its answers are its own (a hit of v1's entry).
        body = {"parameters": {"version": "1"}}
        back = await client.post("/v2/repository/models/tiny/load", headers=admin, json=body)
        assert back.status_code == 200, back.text
        rolled = await embed(client)
        assert rolled.headers["X-Model-Id"] == v1 and rolled.headers["X-Cache"] == "hit"
        assert rolled.content == first.content
        pinned = await embed(client, headers={"X-Model-Id": v1})
        assert pinned.headers["X-Cache"] == "hit" and pinned.content == first.content
        # v2 no longer served: a request pinned to it is refused, never handed its entry.
        gone = await embed(client, headers={"X-Model-Id": v2})
        assert gone.status_code == 409 and "X-Cache" not in gone.headers
        assert [batch.key.model for batch in fake.batches] == [v1, v2]


async def test_a_hit_is_answered_while_the_workers_cannot_be_reached(tmp_path: Path) -> None:
    """Found by the model-based lifecycle test: during a Redis failover, a repeat was
    answered (a hit) while new images got 503 ``broker_unavailable``: the cache answers
    what it holds whatever happens behind it; a request past it hears the truth."""
    broken: list[bool] = []

    def sometimes(task: Task, jobs: Sequence[ImageJob]) -> list[object]:
        if broken:
            return [BrokerUnavailable("Redis is unreachable") for _ in jobs]
        return answer(task, jobs)

    async with serving(tmp_path, FakeTransport(sometimes)) as (_, client):
        kept = await embed(client)
        broken.append(True)
        new = await embed(client, IMAGES[1])
        assert new.status_code == 503 and new.json()["error"]["type"] == "broker_unavailable"
        hit = await embed(client)
        assert hit.status_code == 200 and hit.content == kept.content
        past = await embed(client, headers={"Cache-Control": "no-cache"})
        assert past.status_code == 503
