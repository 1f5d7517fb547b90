"""CPU workers lend their torch threads to a batch while they sit idle."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from app.engine import models_to_serve
from app.metrics import BatchRun
from app.plan import plan_serving
from app.settings import Settings
from app.workers.lending import LEND_AFTER_IDLE_S
from app.workers.pool import WorkerPool
from tests.conftest import distinct_images, embed, expected_for, running_app

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]


async def test_a_lone_batch_borrows_the_threads_of_idle_workers(slow_store: Path) -> None:
    """Two 1-thread workers: a batch that finds the other worker idle (for a while) runs on 2
    threads; one that starts while the other computes keeps its own thread. Answers stay the
    same. An idle server hands consecutive batches to the same worker. slow_store's batch
    (SLOW_STORE_S, 0.25 s on one thread) outlasts the test's look at the workers (every
    1 ms) and the next request's decoding and sending, so that it finds the other busy."""
    images = distinct_images(3)
    runs: list[BatchRun] = []
    pools: list[WorkerPool] = []

    def pool_seen_by_test(settings: Settings) -> WorkerPool:
        plan = plan_serving(settings)
        pools.append(WorkerPool(models_to_serve(plan), plan, on_run=runs.append))
        return pools[-1]

    async with running_app(
        pool_seen_by_test,
        model_store=slow_store,
        cuda_devices="cpu",
        mb_worker_num=2,
        mb_worker_threads=1,
        mb_batch_size=4,
    ) as (_, client):
        (pool,) = pools
        await asyncio.sleep(LEND_AFTER_IDLE_S)

        alone = await embed(client, images[0])
        assert [run.threads for run in runs] == [2]
        (last,) = [w for w in pool.workers if w.batches == 1]

        first = asyncio.create_task(embed(client, images[1]))
        async with asyncio.timeout(10):
            while not any(worker.busy for worker in pool.workers):
                await asyncio.sleep(0.001)
        # The worker that answered last takes the next batch too (its caches are warm).
        assert last.busy
        second = await embed(client, images[2])  # decoded and sent while the slow model computes
        results = [alone, await first, second]
        assert sorted(run.threads for run in runs) == [1, 2, 2]
    for data, result in zip(images, results, strict=True):
        np.testing.assert_allclose(result, expected_for(data, slow_store), atol=1e-5)
