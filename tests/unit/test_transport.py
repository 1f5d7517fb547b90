"""The Transport protocol is the whole seam between the Streamer and the workers: another
transport (here ``app.testing.FakeTransport``, given to ``create_app``) serves the real app,
with no change to the routers, the services or the Streamer, and nothing patched."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import httpx
import numpy as np
import pytest

from app.errors import BatchContractError
from app.images import preprocess
from app.jobs import BatchKey, ImageJob, Task, TopK
from app.main import create_app
from app.manifest import Manifest, read_manifest
from app.settings import Settings
from app.testing import FakeTransport
from tests.conftest import distinct_images
from tests.models import export_tiny


def echo(manifest: Manifest) -> FakeTransport:
    """The embedding is the mean of each channel; the tags are the first k classes."""

    def answer(task: Task, jobs: Sequence[ImageJob]) -> list[object]:
        answers: list[object] = []
        for job in jobs:
            image = job.image
            if isinstance(image, bytes):  # left encoded: decode it, as a worker would
                image = preprocess(image, manifest.input)
            if task is Task.EMBEDDING:
                answers.append(image.reshape(-1, 3).mean(axis=0).astype(np.float32))
            else:
                k = job.top_k
                answers.append(TopK(np.arange(k), np.full(k, 1.0 / k, dtype=np.float32)))
        return answers

    return FakeTransport(answer, batch_size=4, capacity=2)


async def _serve(settings: Settings, transport: FakeTransport) -> list[httpx.Response]:
    served = create_app(settings, transport=transport)
    image = distinct_images(1)[0]
    async with served.router.lifespan_context(served):
        client_transport = httpx.ASGITransport(app=served)
        async with httpx.AsyncClient(transport=client_transport, base_url="http://t") as client:
            return list(
                await asyncio.gather(
                    client.post("/predict/embedding", files={"image": ("a.png", image)}),
                    client.post("/predict/tag?k=2", files={"image": ("a.png", image)}),
                    client.get("/readyz"),
                    client.get("/info"),
                )
            )


def test_another_transport_serves_the_app_unchanged(tmp_path: Path) -> None:
    store = export_tiny(tmp_path / "store")
    manifest = read_manifest(store)
    fake = echo(manifest)
    settings = Settings(model_store=store, mb_request_timeout=20, mb_decode="worker")
    embedding, tags, ready, info = asyncio.run(_serve(settings, fake))
    assert fake.started and fake.closed
    pixels = preprocess(distinct_images(1)[0], manifest.input)
    np.testing.assert_allclose(embedding.json(), pixels.reshape(-1, 3).mean(axis=0), rtol=1e-6)
    assert [tag["name"] for tag in tags.json()] == ["class_0", "class_1"]
    assert ready.status_code == 200 and ready.json()["workers"][0]["device"] == "fake"
    assert info.json()["batching"]["batch_size"] == 4
    # MB_DECODE=worker: uploads travelled encoded, each with a deadline about 20 s out.
    assert {batch.key for batch in fake.batches} == {
        BatchKey(Task.EMBEDDING, True, manifest.model_id),
        BatchKey(Task.TAG, True, manifest.model_id),
    }
    assert all(d is not None for batch in fake.batches for d in batch.deadlines)


def test_a_handler_answering_the_wrong_number_of_jobs_breaks_the_batch_contract(
    tmp_path: Path,
) -> None:
    fake = FakeTransport(lambda task, jobs: [])

    async def run() -> None:
        await fake.start()
        from app.batching import BatchItem

        item = BatchItem(0, ImageJob(b"x"))
        await fake.run_batch(BatchKey(Task.EMBEDDING, True), [item])

    with pytest.raises(BatchContractError, match="answered 0 of 1"):
        asyncio.run(run())


async def _identities(settings: Settings, transport: FakeTransport) -> list[str]:
    served = create_app(settings, transport=transport)
    image = distinct_images(1)[0]
    async with served.router.lifespan_context(served):
        client_transport = httpx.ASGITransport(app=served)
        async with httpx.AsyncClient(transport=client_transport, base_url="http://t") as client:
            answer = await client.post("/predict/embedding", files={"image": ("a.png", image)})
            info = (await client.get("/info")).json()
            v2 = (await client.get(f"/v2/models/{info['model']['arch']}")).json()
            scrape = (await client.get("/metrics")).text
    (model_line,) = [
        line for line in scrape.splitlines() if line.startswith("microbatch_model_info")
    ]
    label = model_line.split('model_id="', 1)[1].split('"', 1)[0]
    return [answer.headers["x-model-id"], info["model_id"], v2["versions"][0], label]


@pytest.mark.parametrize(("dtype", "tag"), [("float32", ""), ("bfloat16", "+bf16")])
def test_a_precision_below_fp32_is_part_of_every_served_id(
    tmp_path: Path, dtype: str, tag: str
) -> None:
    """Vectors of two precisions are never taken for one another: the answer's header, /info,
    the v2 metadata and the metrics all name the precision below fp32; and a broker front
    end's streams are its own (workers of another precision never answer it)."""
    from app.broker.wire.keys import Keys

    store = export_tiny(tmp_path / "store")
    manifest = read_manifest(store)
    settings = Settings(model_store=store, mb_dtype=dtype)
    ids = asyncio.run(_identities(settings, echo(manifest)))
    served = manifest.model_id + tag
    assert ids == [served, served, "1", served]  # v2 names the repository's version number
    keys = Keys("mb")
    assert keys.stream(served, Task.TAG) == f"mb:{{q}}:{manifest.version + tag}:tag"
