"""The Transport protocol is the whole seam between the Streamer and the workers: a transport
that is not the worker pool serves the real app, with no change to the routers, the
services or the Streamer."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

import app.engine
from app.batching import BatchItem
from app.decode_plan import DecodePlan
from app.images import preprocess
from app.jobs import BatchKey, ImageJob, Task, TopK
from app.main import create_app
from app.manifest import Manifest
from app.settings import Settings
from tests.conftest import distinct_images
from tests.models import export_tiny


class EchoTransport:
    """Answers in-process: the embedding is the mean of each channel; the tags are fixed.
    Records every batch it ran and each item's deadline. (mypy checks that ``WorkerPool``
    fills the protocol, where ``app.engine.open_transport`` returns it as a Transport.)"""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.batches: list[tuple[BatchKey, list[float | None]]] = []
        self.started = self.closed = False

    async def start(self) -> None:
        self.started = True

    async def aclose(self) -> None:
        self.closed = True

    async def run_batch(
        self, key: Hashable, items: Sequence[BatchItem[ImageJob]]
    ) -> Mapping[int, Any]:
        assert isinstance(key, BatchKey)
        self.batches.append((key, [item.deadline for item in items]))
        answers: dict[int, Any] = {}
        for item in items:
            image = item.payload.image
            if isinstance(image, bytes):  # left encoded: decode it, as a worker would
                image = preprocess(image, self.manifest.input)
            if key.task is Task.EMBEDDING:
                answers[item.id] = image.reshape(-1, 3).mean(axis=0).astype(np.float32)
            else:
                k = item.payload.top_k
                answers[item.id] = TopK(np.arange(k), np.full(k, 1.0 / k, dtype=np.float32))
        return answers

    capacity = 2
    batch_size = 4
    ready = True
    restart_count = 0
    shared_queue_depth = 0

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "index": 0,
                "device": "echo",
                "threads": 1,
                "pid": None,
                "ready": True,
                "alive": True,
                "batch_size": 4,
                "batches": len(self.batches),
                "items": 0,
            }
        ]


def test_another_transport_serves_the_app_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = export_tiny(tmp_path / "store")
    transports: list[EchoTransport] = []

    def open_echo(settings: Settings, manifest: Manifest, metrics: Any) -> Any:
        transports.append(EchoTransport(manifest))
        return app.engine.OpenedTransport(
            transports[-1], DecodePlan(server_threads=0, worker_threads=1), "in-process echo"
        )

    monkeypatch.setattr(app.engine, "open_transport", open_echo)
    served = create_app(Settings(model_store=store, mb_request_timeout=20))
    image = distinct_images(1)[0]

    async def scenario() -> list[httpx.Response]:
        async with served.router.lifespan_context(served):
            transport = httpx.ASGITransport(app=served)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                return list(
                    await asyncio.gather(
                        client.post("/predict/embedding", files={"image": ("a.png", image)}),
                        client.post("/predict/tag?k=2", files={"image": ("a.png", image)}),
                        client.get("/readyz"),
                        client.get("/info"),
                    )
                )

    embedding, tags, ready, info = asyncio.run(scenario())
    (echo,) = transports
    assert echo.started and echo.closed
    pixels = preprocess(image, echo.manifest.input)
    np.testing.assert_allclose(embedding.json(), pixels.reshape(-1, 3).mean(axis=0), rtol=1e-6)
    assert [tag["name"] for tag in tags.json()] == ["class_0", "class_1"]
    assert ready.status_code == 200 and ready.json()["workers"][0]["device"] == "echo"
    assert info.json()["batching"]["batch_size"] == 4
    # Uploads travelled encoded, each with a deadline about 20 s out.
    keys = {key for key, _ in echo.batches}
    assert keys == {BatchKey(Task.EMBEDDING, True), BatchKey(Task.TAG, True)}
    assert all(deadline is not None for _, deadlines in echo.batches for deadline in deadlines)
