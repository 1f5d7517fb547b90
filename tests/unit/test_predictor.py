"""Where the Predictor decodes an upload (in its decode threads, or not at all: the worker
decodes), as its DecodePlan says, and how it keys the batch the upload joins."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from app.errors import InvalidImage
from app.jobs import BatchKey, ImageJob, Task
from app.manifest import FileEntry, Manifest
from app.plan import DecodePlan
from app.services.predictor import Predictor
from tests.unit.test_images import SPEC, encode, gradient

AUTO_ON_CPU = DecodePlan(server_threads=1, worker_threads=1, idle_uploads_to_workers=True)
SERVER = DecodePlan(server_threads=1, worker_threads=0)
WORKERS = DecodePlan(server_threads=0, worker_threads=1)


class FakeStreamer:
    """Records what is submitted, and under which key; ``idle`` as the test sets it."""

    def __init__(self, idle: bool) -> None:
        self.idle = idle
        self.submitted: list[tuple[ImageJob, Any]] = []

    def check_admission(self) -> None:
        pass

    async def submit(self, job: ImageJob, *, key: Any, **_: Any) -> object:
        self.submitted.append((job, key))
        return np.zeros(4, dtype=np.float32)


def _predictor(
    streamer: FakeStreamer, plan: DecodePlan, pool: ThreadPoolExecutor | None
) -> Predictor:
    entry = FileEntry(path="unused", sha256="0" * 64)
    manifest = Manifest(
        arch="tiny",
        weights="random",
        input=SPEC,
        embedding_dim=4,
        num_classes=10,
        files={"embedding": entry, "classifier": entry, "classes": entry},
    )
    return Predictor(
        streamer,  # type: ignore[arg-type]
        manifest,
        [str(i) for i in range(10)],
        plan,
        pool,
        max_pixels=10**6,
    )


@pytest.mark.parametrize(
    ("plan", "idle", "decoded"),
    [
        (AUTO_ON_CPU, True, False),  # idle: the worker decodes
        (AUTO_ON_CPU, False, True),  # busy: decoded here, overlapping the model
        (SERVER, True, True),  # always here
        (SERVER, False, True),
        (WORKERS, True, False),  # never here
        (WORKERS, False, False),
    ],
)
def test_where_the_predictor_decodes(plan: DecodePlan, idle: bool, decoded: bool) -> None:
    upload = encode(gradient(48, 40), "PNG")
    streamer = FakeStreamer(idle)
    with ThreadPoolExecutor(1) as pool:
        predictor = _predictor(streamer, plan, pool if plan.server_threads else None)
        asyncio.run(predictor.embedding(upload, time.monotonic() + 10))
    ((job, key),) = streamer.submitted
    # Decoded and encoded images never share a batch: the key tells them apart.
    assert key == BatchKey(Task.EMBEDDING, encoded=not decoded)
    if decoded:
        assert isinstance(job.image, np.ndarray) and job.image.shape == (32, 32, 3)
    else:
        assert job.image == upload


def test_a_bad_upload_decoded_here_is_refused_before_it_is_queued() -> None:
    streamer = FakeStreamer(idle=False)
    with ThreadPoolExecutor(1) as pool:
        predictor = _predictor(streamer, AUTO_ON_CPU, pool)
        with pytest.raises(InvalidImage):
            asyncio.run(predictor.embedding(b"not an image", time.monotonic() + 10))
    assert streamer.submitted == []


def test_a_decode_pool_comes_with_a_plan_that_decodes_here() -> None:
    with ThreadPoolExecutor(1) as pool, pytest.raises(ValueError, match="decode pool"):
        _predictor(FakeStreamer(idle=True), WORKERS, pool)
    with pytest.raises(ValueError, match="decode pool"):
        _predictor(FakeStreamer(idle=True), SERVER, None)
