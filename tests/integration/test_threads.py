"""CPU workers lend their torch threads to a batch while they sit idle."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from app.images import preprocess
from app.manifest import read_manifest
from tests.conftest import distinct_images, running_app
from tests.models import tiny_expected_embedding

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]


async def test_a_lone_batch_borrows_the_threads_of_idle_workers(slow_store: Path) -> None:
    """Two 1-thread workers: a batch that finds the other worker idle runs on 2 threads; one
    that starts while the other computes keeps its own thread. Answers stay the same. An idle
    server hands consecutive batches to the same worker."""
    spec = read_manifest(slow_store).input
    images = distinct_images(3)
    async with running_app(
        model_store=slow_store,
        cuda_devices="cpu",
        mb_worker_num=2,
        mb_worker_threads=1,
        mb_batch_size=4,
    ) as (app, client):
        pool = app.state.pool

        async def embed(data: bytes) -> list[float]:
            response = await client.post("/predict/embedding", files={"image": ("x.png", data)})
            assert response.status_code == 200, response.text
            return response.json()  # type: ignore[no-any-return]

        alone = await embed(images[0])
        assert pool.stats.threads == {2: 1}
        (last,) = [w for w in pool._workers if w.batches == 1]

        first = asyncio.create_task(embed(images[1]))
        async with asyncio.timeout(10):
            while not any(worker.pending for worker in pool._workers):
                await asyncio.sleep(0.001)
        # The worker that answered last takes the next batch too (its caches are warm).
        assert last.pending is not None
        second = await embed(images[2])  # decoded and sent while the slow model computes
        results = [alone, await first, second]
        assert pool.stats.threads == {2: 2, 1: 1}
    for data, result in zip(images, results, strict=True):
        np.testing.assert_allclose(
            result, tiny_expected_embedding(preprocess(data, spec)), atol=1e-5
        )
