"""The serving engine shared by the HTTP server and the batch job: verify the model store,
start a transport (the model workers), put a Streamer in front of it and a Predictor on top,
and stop it all again."""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from urllib.parse import urlsplit

from app.batching import Streamer, Transport
from app.decode_plan import DecodePlan
from app.jobs import BatchKey, ImageJob
from app.manifest import Manifest, read_classes, read_manifest
from app.metrics import Metrics
from app.services.predictor import Predictor
from app.settings import Settings

log = logging.getLogger("app")


@dataclass(frozen=True)
class OpenedTransport:
    transport: Transport[ImageJob]
    decode: DecodePlan  # where uploads are decoded with it
    summary: str  # for the start-up log line


def open_transport(
    settings: Settings, manifest: Manifest, metrics: Metrics | None
) -> OpenedTransport:
    """The transport these settings ask for (not started yet), and where uploads are
    decoded with it: model worker processes on this machine, or (``MB_BROKER``) the
    workers behind a Redis broker, which decode every upload."""
    if settings.mb_broker is not None:
        from app.broker.keys import Keys  # no redis client, nor torch, unless asked for
        from app.broker.transport import BrokerTransport

        broker = BrokerTransport(
            settings.mb_broker.get_secret_value(),
            Keys(settings.mb_broker_prefix, manifest.version),
            max_queue=settings.mb_max_queue,
            on_workers=metrics.on_workers if metrics else None,
        )
        where = urlsplit(settings.mb_broker.get_secret_value())
        summary = f"through the broker at {where.scheme}://{where.hostname}:{where.port or 6379}"
        return OpenedTransport(broker, DecodePlan.front_end(), summary)
    from app.workers.plan import plan_from_settings, worker_config
    from app.workers.pool import WorkerPool

    plan = plan_from_settings(settings)
    pool = WorkerPool(
        manifest,
        plan,
        worker_config(settings, plan),
        start_timeout_s=settings.mb_worker_start_timeout,
        batch_timeout_s=settings.mb_batch_timeout,
        on_compute=metrics.on_compute if metrics else None,
    )
    summary = (
        f"batch<={settings.max_batch_size}, max latency {settings.mb_max_latency:g} s, "
        f"{len(plan.devices)} worker(s) on {', '.join(sorted(set(plan.devices)))}"
    )
    return OpenedTransport(pool, plan.decode, summary)


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
        self.summary = ""  # what serves the batches, for the log and /info

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

    @property
    def queue_depth(self) -> int:
        """Requests waiting: in this process's queue, and (broker mode) in the shared one."""
        return self.streamer.queue_depth + self.transport.shared_queue_depth

    async def start(self) -> None:
        """Verify the store, start every worker (raises ``StartupError`` with a clear
        message if one cannot start), then the Streamer. Undoes what it started if any of
        that fails."""
        settings, metrics = self.settings, self.metrics
        try:
            # A broker front end holds no weights: it needs the model's identity, input size
            # and class names only.
            roles = ("classes",) if settings.mb_broker is not None else None
            self.manifest = read_manifest(settings.model_store, verify=True, roles=roles)
            classes = read_classes(settings.model_store, self.manifest)
            opened = open_transport(settings, self.manifest, metrics)
            self._transport, plan = opened.transport, opened.decode
            self.decode_plan, self.summary = plan, opened.summary
            await self._transport.start()
            self._streamer = Streamer(
                self._transport.run_batch,
                max_batch_size=self._transport.batch_size,
                max_latency_s=settings.mb_max_latency,
                max_queue_size=settings.mb_max_queue,
                max_concurrent_batches=self._transport.capacity,
                default_timeout_s=settings.mb_request_timeout,
                on_batch=self._on_batch if metrics and not metrics.remote_workers else None,
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
            "serving %s from %s, %s; decoding in %s",
            self.manifest.arch,
            settings.model_store,
            opened.summary,
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
