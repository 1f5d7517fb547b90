"""The serving engine shared by the HTTP server and the batch job: verify the model store,
start a transport (the model workers, or the broker), put a Streamer in front of it and a
Predictor on top, and stop it all again. The only module that wires those pieces together."""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

from app.batching import Streamer, Transport
from app.jobs import BatchKey, ImageJob
from app.manifest import Manifest, model_version, read_classes, read_manifest
from app.metrics import Metrics
from app.plan import Role, ServingPlan
from app.services.predictor import Predictor

log = logging.getLogger("app")


def default_transport(
    plan: ServingPlan, manifest: Manifest, metrics: Metrics | None = None
) -> Transport[ImageJob]:
    """The transport the plan asks for (not started yet): model worker processes on this
    machine, or, for a broker front end, the workers behind Redis."""
    if plan.role is Role.FRONT_END:
        assert plan.broker is not None
        from app.broker.keys import Keys  # no redis client unless asked for
        from app.broker.transport import BrokerTransport

        # Streams per export and precision: workers computing in another dtype never answer.
        served = manifest.served_id(plan.worker.dtype)
        return BrokerTransport(
            plan.broker.url,
            Keys(plan.broker.prefix, model_version(served)),
            max_queue=plan.limits.max_queue,
            on_workers=metrics.on_workers if metrics else None,
        )
    from app.workers.pool import WorkerPool

    return WorkerPool(manifest, plan, on_run=metrics.on_run if metrics else None)


class Engine:
    """A running transport, its Streamer, and a Predictor over them; an async context
    manager, so nothing outlives the block that uses it (workers, threads, shared memory).
    ``transport`` replaces the one the plan asks for (``default_transport``), e.g. an
    ``app.testing.FakeTransport``; the engine starts and closes it all the same.

    >>> # async with Engine(plan_serving(settings)) as engine:
    >>> #     tags = await engine.predictor.tag(jpeg_bytes, 5, deadline)
    """

    def __init__(
        self,
        plan: ServingPlan,
        metrics: Metrics | None = None,
        *,
        transport: Transport[ImageJob] | None = None,
        drain_timeout_s: float = 0.0,
    ) -> None:
        self.plan = plan
        self.metrics = metrics
        self.drain_timeout_s = drain_timeout_s  # how long closing lets admitted work finish
        self._given_transport = transport
        self._decode_pool: ThreadPoolExecutor | None = None
        self._transport: Transport[ImageJob] | None = None
        self._streamer: Streamer[ImageJob, object] | None = None
        self._predictor: Predictor | None = None
        self.manifest: Manifest | None = None

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
        plan, metrics, limits = self.plan, self.metrics, self.plan.limits
        try:
            # A broker front end holds no weights: it needs the model's identity, input size
            # and class names only.
            roles = ("classes",) if plan.role is Role.FRONT_END else None
            self.manifest = read_manifest(plan.model_store, verify=True, roles=roles)
            classes = read_classes(plan.model_store, self.manifest)
            self._transport = self._given_transport or default_transport(
                plan, self.manifest, metrics
            )
            await self._transport.start()
            self._streamer = Streamer(
                self._transport.run_batch,
                max_batch_size=self._transport.batch_size,
                max_latency_s=limits.max_latency_s,
                max_queue_size=limits.max_queue,
                max_concurrent_batches=self._transport.capacity,
                default_timeout_s=limits.request_timeout_s,
                on_batch=self._on_batch if metrics and not plan.remote_workers else None,
            )
            if plan.decode.server_threads:
                self._decode_pool = ThreadPoolExecutor(
                    plan.decode.server_threads, thread_name_prefix="decode"
                )
            await self._streamer.start()
            self._predictor = Predictor(
                self._streamer,
                self.manifest,
                classes,
                plan.decode,
                self._decode_pool,
                max_pixels=plan.worker.max_pixels,
                model_id=self.manifest.served_id(plan.worker.dtype),
            )
        except BaseException:
            await self.aclose()
            raise
        log.info(
            "serving %s from %s, %s; decoding in %s",
            self.manifest.arch,
            plan.model_store,
            plan.describe(),
            plan.decode.describe(),
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
