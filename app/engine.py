"""The serving engine shared by the HTTP server and the batch job: verify the model store,
start a transport (the model workers), put a Streamer in front of it and a Predictor on top,
and stop it all again."""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

from app.batching import Streamer, Transport
from app.decode_plan import DecodePlan
from app.jobs import BatchKey, ImageJob
from app.manifest import Manifest, read_classes, read_manifest
from app.metrics import Metrics
from app.services.predictor import Predictor
from app.settings import Settings
from app.workers.devices import cuda_device_count
from app.workers.messages import WorkerConfig
from app.workers.plan import WorkerPlan, plan_workers
from app.workers.pool import WorkerPool

log = logging.getLogger("app")


def plan_from_settings(settings: Settings) -> WorkerPlan:
    """Devices, threads and decode placement for these settings on this machine."""
    return plan_workers(
        cuda_devices=settings.cuda_device_ids,
        worker_num=settings.mb_worker_num,
        worker_threads=settings.mb_worker_threads,
        decode=settings.mb_decode,
        decode_threads=settings.mb_decode_threads,
        available_gpus=cuda_device_count(),
        cpu_count=os.cpu_count() or 1,
    )


def worker_config(settings: Settings, plan: WorkerPlan) -> WorkerConfig:
    """What every model worker loads, and how."""
    return WorkerConfig(
        model_store=str(settings.model_store),
        max_batch_size=settings.max_batch_size,
        auto_batch=settings.mb_batch_size == "auto",
        dtype=settings.mb_dtype,
        optimize=settings.mb_optimize,
        decode_threads=plan.decode.worker_threads,
        decode_on_device=plan.decode.on_device,
        max_pixels=settings.max_image_pixels,
    )


def open_transport(
    settings: Settings, manifest: Manifest, metrics: Metrics | None
) -> tuple[Transport[ImageJob], DecodePlan]:
    """The transport these settings ask for (not started yet), and where uploads are
    decoded with it: model worker processes on this machine."""
    plan = plan_from_settings(settings)
    pool = WorkerPool(
        manifest,
        plan,
        worker_config(settings, plan),
        start_timeout_s=settings.mb_worker_start_timeout,
        batch_timeout_s=settings.mb_batch_timeout,
        on_compute=metrics.on_compute if metrics else None,
    )
    return pool, plan.decode


class Engine:
    """A running transport, its Streamer, and a Predictor over them; an async context
    manager, so nothing outlives the block that uses it (workers, threads, shared memory).

    >>> # async with Engine(settings) as engine:
    >>> #     tags = await engine.predictor.tag(jpeg_bytes, 5, deadline)
    """

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics | None = None,
        *,
        drain_timeout_s: float = 0.0,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.drain_timeout_s = drain_timeout_s  # how long closing lets admitted work finish
        self._decode_pool: ThreadPoolExecutor | None = None
        self._transport: Transport[ImageJob] | None = None
        self._streamer: Streamer[ImageJob, object] | None = None
        self._predictor: Predictor | None = None
        self.manifest: Manifest | None = None
        self.decode_plan: DecodePlan | None = None

    @property
    def transport(self) -> Transport[ImageJob]:
        assert self._transport is not None, "start the engine first"
        return self._transport

    @property
    def streamer(self) -> Streamer[ImageJob, object]:
        assert self._streamer is not None, "start the engine first"
        return self._streamer

    @property
    def predictor(self) -> Predictor:
        assert self._predictor is not None, "start the engine first"
        return self._predictor

    async def start(self) -> None:
        """Verify the store, start every worker (raises ``StartupError`` with a clear
        message if one cannot start), then the Streamer. Undoes what it started if any of
        that fails."""
        settings, metrics = self.settings, self.metrics
        try:
            self.manifest = read_manifest(settings.model_store, verify=True)
            classes = read_classes(settings.model_store, self.manifest)
            self._transport, plan = open_transport(settings, self.manifest, metrics)
            self.decode_plan = plan
            await self._transport.start()
            self._streamer = Streamer(
                self._transport.run_batch,
                max_batch_size=self._transport.batch_size,
                max_latency_s=settings.mb_max_latency,
                max_queue_size=settings.mb_max_queue,
                max_concurrent_batches=self._transport.capacity,
                default_timeout_s=settings.mb_request_timeout,
                on_batch=self._on_batch if metrics else None,
            )
            if plan.server_threads:
                self._decode_pool = ThreadPoolExecutor(
                    plan.server_threads, thread_name_prefix="decode"
                )
            await self._streamer.start()
            self._predictor = Predictor(
                self._streamer,
                self.manifest,
                classes,
                plan,
                self._decode_pool,
                max_pixels=settings.max_image_pixels,
            )
        except BaseException:
            await self.aclose()
            raise
        log.info(
            "serving %s from %s: batch<=%d, max latency %g s, %d worker(s), decoding in %s",
            self.manifest.arch,
            settings.model_store,
            self._transport.batch_size,
            settings.mb_max_latency,
            self._transport.capacity,
            plan.describe(),
        )

    def _on_batch(self, key: Hashable, size: int, waits: Sequence[float]) -> None:
        assert self.metrics is not None and isinstance(key, BatchKey)
        self.metrics.on_batch(key.task.value, size, waits)

    async def aclose(self) -> None:
        """Let admitted work finish (up to ``drain_timeout_s``), then stop everything.
        Idempotent."""
        if self._streamer is not None:
            await self._streamer.aclose(drain_timeout_s=self.drain_timeout_s)
        if self._transport is not None:
            await self._transport.aclose()
        if self._decode_pool is not None:
            self._decode_pool.shutdown(wait=False, cancel_futures=True)
            self._decode_pool = None

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
