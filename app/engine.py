"""The serving engine shared by the HTTP server and the batch job: verify the model store,
start the workers, put a Streamer in front of them, and stop it all again."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from app.batching import Streamer
from app.jobs import ImageJob
from app.manifest import Manifest, read_classes, read_manifest
from app.metrics import Metrics
from app.services.predictor import Predictor
from app.settings import Settings
from app.workers.pool import WorkerPool

log = logging.getLogger("app")


@dataclass
class Engine:
    """Running workers, their Streamer, and a Predictor over them.

    >>> # async with start_engine(settings) as engine:  (see ``start_engine``)
    >>> #     tags = await engine.predictor.tag(jpeg_bytes, 5, deadline)
    """

    settings: Settings
    manifest: Manifest
    pool: WorkerPool
    streamer: Streamer[ImageJob, object]
    decode_pool: ThreadPoolExecutor | None  # None: the workers decode
    predictor: Predictor

    async def aclose(self, drain_timeout_s: float = 0.0) -> None:
        """Let admitted work finish (up to ``drain_timeout_s``), then stop everything."""
        await self.streamer.aclose(drain_timeout_s=drain_timeout_s)
        await self.pool.aclose()
        if self.decode_pool is not None:
            self.decode_pool.shutdown(wait=False, cancel_futures=True)


async def start_engine(settings: Settings, metrics: Metrics | None = None) -> Engine:
    """Verify the store, start every worker (raises ``StartupError`` with a clear message if
    one cannot start), then the Streamer."""
    manifest = read_manifest(settings.model_store, verify=True)
    classes = read_classes(settings.model_store, manifest)
    pool = WorkerPool(
        model_store=settings.model_store,
        manifest=manifest,
        devices=settings.cuda_device_ids,
        worker_num=settings.mb_worker_num,
        threads_per_worker=settings.mb_worker_threads,
        max_batch_size=settings.max_batch_size,
        auto_batch=settings.mb_batch_size == "auto",
        decode=settings.mb_decode,
        decode_threads=settings.mb_decode_threads,
        max_pixels=settings.max_image_pixels,
        dtype=settings.mb_dtype,
        optimize=settings.mb_optimize,
        on_compute=metrics.on_compute if metrics else None,
        start_timeout_s=settings.mb_worker_start_timeout,
        batch_timeout_s=settings.mb_batch_timeout,
    )
    await pool.start()
    streamer: Streamer[ImageJob, object] = Streamer(
        pool.run_batch,
        max_batch_size=pool.batch_size,
        max_latency_s=settings.mb_max_latency,
        max_queue_size=settings.mb_max_queue,
        max_concurrent_batches=pool.capacity,
        default_timeout_s=settings.mb_request_timeout,
        on_batch=metrics.on_batch if metrics else None,
    )
    decode_pool = None
    if not pool.decode_in_workers:
        threads = settings.mb_decode_threads or min(8, os.cpu_count() or 1)
        decode_pool = ThreadPoolExecutor(threads, thread_name_prefix="decode")
    await streamer.start()
    predictor = Predictor(
        streamer,
        manifest,
        classes,
        decode_pool,
        max_pixels=settings.max_image_pixels,
        idle_workers_decode=pool.workers_can_decode,
    )
    where = "the workers"
    if not pool.decode_in_workers:
        where = "the server (the workers when idle)" if pool.workers_can_decode else "the server"
    log.info(
        "serving %s from %s: batch<=%d, max latency %g s, %d worker(s), decoding in %s",
        manifest.arch,
        settings.model_store,
        pool.batch_size,
        settings.mb_max_latency,
        pool.capacity,
        where,
    )
    return Engine(settings, manifest, pool, streamer, decode_pool, predictor)
