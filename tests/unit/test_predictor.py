"""Where the Predictor decodes an upload: in its decode threads, or not at all (the worker
decodes), depending on MB_DECODE and on whether the server is idle."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from app.errors import InvalidImage
from app.jobs import ImageJob
from app.manifest import Manifest
from app.services.predictor import Predictor
from tests.unit.test_images import SPEC, encode, gradient


class FakeStreamer:
    """Records what is submitted; ``idle`` as the test sets it."""

    def __init__(self, idle: bool) -> None:
        self.idle = idle
        self.jobs: list[ImageJob] = []

    def check_admission(self) -> None:
        pass

    async def submit(self, job: ImageJob, **_: Any) -> object:
        self.jobs.append(job)
        return np.zeros(4, dtype=np.float32)


def _predictor(
    streamer: FakeStreamer, pool: ThreadPoolExecutor | None, idle_workers_decode: bool
) -> Predictor:
    manifest = Manifest(
        arch="tiny", weights="random", input=SPEC, embedding_dim=4, num_classes=10, files={}
    )
    return Predictor(
        streamer,  # type: ignore[arg-type]
        manifest,
        [str(i) for i in range(10)],
        pool,
        max_pixels=10**6,
        idle_workers_decode=idle_workers_decode,
    )


@pytest.mark.parametrize(
    ("threads", "idle_workers_decode", "idle", "decoded"),
    [
        (True, True, True, False),  # auto on CPU, idle: the worker decodes
        (True, True, False, True),  # auto on CPU, busy: decoded here, overlapping the model
        (True, False, True, True),  # MB_DECODE=server: always here
        (True, False, False, True),
        (False, True, True, False),  # MB_DECODE=worker (or a GPU): never here
        (False, True, False, False),
    ],
)
def test_where_the_predictor_decodes(
    threads: bool, idle_workers_decode: bool, idle: bool, decoded: bool
) -> None:
    upload = encode(gradient(48, 40), "PNG")
    streamer = FakeStreamer(idle)
    with ThreadPoolExecutor(1) as pool:
        predictor = _predictor(streamer, pool if threads else None, idle_workers_decode)
        asyncio.run(predictor.embedding(upload, time.monotonic() + 10))
    (job,) = streamer.jobs
    if decoded:
        assert isinstance(job.image, np.ndarray) and job.image.shape == (32, 32, 3)
    else:
        assert job.image == upload


def test_a_bad_upload_decoded_here_is_refused_before_it_is_queued() -> None:
    streamer = FakeStreamer(idle=False)
    with ThreadPoolExecutor(1) as pool:
        predictor = _predictor(streamer, pool, idle_workers_decode=True)
        with pytest.raises(InvalidImage):
            asyncio.run(predictor.embedding(b"not an image", time.monotonic() + 10))
    assert streamer.jobs == []
