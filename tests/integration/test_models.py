"""The real default model: correct tags, batched == single, and loud start-up failures."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from app.engine import models_to_serve
from app.errors import ModelStoreError, WorkerStartError
from app.images import preprocess
from app.jobs import BatchKey, Task
from app.manifest import read_manifest, sha256_file
from app.plan import plan_serving
from app.repository import Repository
from app.settings import load_settings
from app.workers.models import load_models
from app.workers.pool import WorkerPool
from app.workers.runner import BatchRunner
from tests.conftest import distinct_images, running_app

pytestmark = pytest.mark.slow

CAT_CLASSES = {"tabby", "tiger cat", "Persian cat", "Siamese cat", "Egyptian cat"}


@pytest.mark.parametrize("decode", ["server", "device"])
async def test_default_model_tags_a_cat_and_an_espresso(
    default_store: Path, cat_jpeg: bytes, coffee_jpeg: bytes, decode: str
) -> None:
    async with running_app(
        model_store=default_store, cuda_devices="cpu", mb_worker_num=1, mb_decode=decode
    ) as (_, client):
        cat, coffee = await asyncio.gather(
            client.post("/predict/tag", files={"image": ("cat.jpg", cat_jpeg)}),
            client.post("/predict/tag", files={"image": ("coffee.jpg", coffee_jpeg)}),
        )
        embedding = await client.post("/predict/embedding", files={"image": ("c.jpg", cat_jpeg)})
    assert cat.status_code == coffee.status_code == 200
    assert cat.json()[0]["name"] in CAT_CLASSES, cat.json()
    assert "espresso" in [t["name"] for t in coffee.json()], coffee.json()
    assert len(embedding.json()) == 1280


def test_batched_results_equal_single_image_results(
    default_store: Path, cat_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    torch.set_num_threads(2)
    spec = read_manifest(default_store).input
    runner = BatchRunner(load_models(default_store, torch.device("cpu")), torch.device("cpu"))
    uploads = [cat_jpeg, coffee_jpeg, *distinct_images(4, size=300)]
    pixels = np.stack([preprocess(data, spec) for data in uploads])
    batched = runner.run(Task.EMBEDDING, pixels, 0)["embedding"]
    tags = runner.run(Task.TAG, pixels, 5)
    both = runner.run(Task.EMBEDDING_AND_TAG, pixels, 5)  # one pass: the same answers
    assert set(both) == {"embedding", "indices", "probs"}
    np.testing.assert_allclose(both["embedding"], batched, rtol=1e-5, atol=1e-5)
    assert both["indices"].tolist() == tags["indices"].tolist()
    np.testing.assert_allclose(both["probs"], tags["probs"], atol=1e-6)
    for row in range(len(uploads)):
        alone = runner.run(Task.EMBEDDING, pixels[row : row + 1], 0)["embedding"][0]
        np.testing.assert_allclose(batched[row], alone, rtol=1e-4, atol=1e-4)
        alone_tags = runner.run(Task.TAG, pixels[row : row + 1], 5)
        assert list(alone_tags["indices"][0]) == list(tags["indices"][row])
        np.testing.assert_allclose(alone_tags["probs"][0], tags["probs"][row], atol=1e-5)


def copy_store(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_tampered_model_file_is_refused(tiny_store: Path, tmp_path: Path) -> None:
    store = copy_store(tiny_store, tmp_path / "store")
    with (store / "classifier.pt").open("ab") as handle:
        handle.write(b"tampered")
    with pytest.raises(ModelStoreError, match="sha256"):
        read_manifest(store)


async def test_worker_start_failure_is_a_clear_error(tiny_store: Path, tmp_path: Path) -> None:
    # A store whose checksums match but whose model file is not TorchScript at all.
    store = copy_store(tiny_store, tmp_path / "store")
    (store / "embedding.pt").write_bytes(b"this is not a model")
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["files"]["embedding"]["sha256"] = sha256_file(store / "embedding.pt")
    (store / "manifest.json").write_text(json.dumps(manifest))
    settings = load_settings(
        model_store=store, cuda_devices="cpu", mb_worker_num=1, mb_batch_size=4
    )
    plan = plan_serving(settings)
    pool = WorkerPool(models_to_serve(plan), plan)
    repository = Repository.of_plan(plan.repository)
    pool.models.attach(repository, plan.worker.dtype, lambda view: None, lambda served: False)
    with pytest.raises(WorkerStartError, match=r"worker 0 on cpu failed to start: .*load"):
        await pool.start()  # start-up is a load: it fails as a load does, saying why
    assert pool.worker_status() == []


async def test_missing_model_store_fails_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused as the app is built, in one line that says how to export a model."""
    with pytest.raises(SystemExit) as exited:
        async with running_app(model_store=tmp_path / "nothing", cuda_devices="cpu"):
            pass
    assert exited.value.code == 2
    assert re.search(r"^error: no model in .*app\.export", capsys.readouterr().err)


async def test_several_cpu_workers_share_the_load(tiny_store: Path) -> None:
    async with running_app(
        model_store=tiny_store, cuda_devices="cpu", mb_worker_num=2, mb_batch_size=4
    ) as (app, client):
        images = distinct_images(40)
        responses = await asyncio.gather(
            *(client.post("/predict/embedding", files={"image": ("x.png", d)}) for d in images)
        )
        workers = app.state.engine.transport.worker_status()
    assert all(r.status_code == 200 for r in responses)
    assert len(workers) == 2 and all(w.ready and w.alive for w in workers)
    assert len({w.pid for w in workers}) == 2
    assert all(w.batches > 0 for w in workers), workers


async def test_auto_batch_size_is_measured_and_used(tiny_store: Path) -> None:
    async with running_app(
        model_store=tiny_store,
        cuda_devices="cpu",
        mb_worker_num=1,
        mb_batch_size="auto",
        mb_auto_batch_max=8,
    ) as (app, client):
        worker = app.state.engine.transport.worker_status()[0]
        ready = (await client.get("/readyz")).json()
        (served,) = worker.models
        key = BatchKey(Task.EMBEDDING, False, served.served_id)
        streamer_batch = app.state.engine.streamer.batch_size(key)
    assert 1 <= worker.batch_size <= 8
    assert streamer_batch == worker.batch_size  # the batches the Streamer forms of that model
    assert ready["workers"][0]["batch_size"] == worker.batch_size


def test_bfloat16_agrees_with_float32_on_the_photos(
    default_store: Path, cat_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    from app.workers.models import LoadOptions

    spec = read_manifest(default_store).input
    pixels = np.stack([preprocess(data, spec) for data in (cat_jpeg, coffee_jpeg)])
    cpu = torch.device("cpu")
    full = BatchRunner(load_models(default_store, cpu), cpu).run(Task.TAG, pixels, 5)
    half = BatchRunner(load_models(default_store, cpu, LoadOptions(dtype=torch.bfloat16)), cpu).run(
        Task.TAG, pixels, 5
    )
    assert list(half["indices"][:, 0]) == list(full["indices"][:, 0])  # same top-1
    np.testing.assert_allclose(half["probs"][:, 0], full["probs"][:, 0], atol=0.05)
