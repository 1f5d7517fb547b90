"""The serving engine shared by the HTTP server and the batch job: read the model repository,
start a transport (the model workers, or the broker) with the versions to serve, put a
Streamer in front of it, and the model registry and its manager on top, one Predictor per
serving version; and stop it all again. The only module that wires those pieces together."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any

from app.batching import QueueBacklog, Streamer, Transport
from app.errors import NotReady
from app.jobs import BatchKey, ImageJob
from app.manifest import Manifest
from app.metrics import BatchRun, Metrics
from app.plan import Role, ServingPlan
from app.repository import ModelSpec, Repository, Route
from app.services.models import ModelHost, ModelManager, VersionOnDisk
from app.services.predictor import Predictor
from app.services.registry import ModelRegistry

log = logging.getLogger("app")


def repository_of(plan: ServingPlan) -> Repository:
    """The model repository the plan names: a repository, or a lone store as one."""
    where = plan.repository
    if where.single:
        return Repository.of_store(where.root, where.pins)
    return Repository(where.root, pins=where.pins)


def default_transport(
    plan: ServingPlan,
    models: Sequence[ModelSpec],
    metrics: Metrics | None = None,
    *,
    on_routes: Callable[[dict[str, Route]], None] | None = None,
    labels: Callable[[str], tuple[str, str]] = lambda served_id: (served_id, ""),
) -> Transport[ImageJob]:
    """The transport the plan asks for (not started yet): model worker processes on this
    machine holding ``models``, or, for a broker front end, the workers behind Redis
    (``on_routes`` hears which version each name serves, as their heartbeats say)."""
    if plan.role is Role.FRONT_END:
        assert plan.broker is not None
        from app.broker.transport import BrokerTransport  # no redis client unless asked for

        return BrokerTransport(
            plan.broker.url,
            plan.broker.prefix,
            max_queue=plan.limits.max_queue,
            switch_min_workers=plan.repository.switch_min_workers,
            on_workers=metrics.on_workers if metrics else None,
            on_routes=on_routes,
            scale_from_zero=plan.broker.scale_from_zero,
            own_routes={model.name: Route(model.version, model.served_id) for model in models},
        )
    from app.workers.pool import WorkerPool

    def on_run(run: BatchRun) -> None:
        assert metrics is not None
        metrics.on_run(run, *labels(run.model))

    return WorkerPool(models, plan, on_run=on_run if metrics else None)


def models_to_serve(plan: ServingPlan) -> list[ModelSpec]:
    """The version of each model a process started with ``plan`` serves first (for a
    transport built outside the engine, as tests do)."""
    manager = ModelManager(
        ModelRegistry(), repository_of(plan), None, _no_predictor, dtype=plan.worker.dtype,
        drain_timeout_s=0, verify=False,
    )  # fmt: skip
    return [item.spec for item in manager.read_chosen()]


def _no_predictor(manifest: Manifest, classes: list[str], served_id: str) -> Predictor:
    raise AssertionError("reading only")


class Engine:
    """A running transport, its Streamer, and the models it serves (``models``: the
    manager; ``registry``: its state); an async context manager, so nothing outlives the
    block that uses it (workers, threads, shared memory). ``transport`` replaces the one the
    plan asks for (``default_transport``), e.g. an ``app.testing.FakeTransport``; the engine
    starts and closes it all the same.

    >>> # async with Engine(plan_serving(settings)) as engine:
    >>> #     with engine.registry.admit("tagger") as version:
    >>> #         tags = await version.predictor.tag(jpeg_bytes, 5, deadline)
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
        self.registry = ModelRegistry(plan.repository.default_model)
        self._manager: ModelManager | None = None

    @property
    def transport(self) -> Transport[ImageJob]:
        assert self._transport is not None, "start the engine first"
        return self._transport

    @property
    def streamer(self) -> Streamer[ImageJob, object]:
        assert self._streamer is not None, "start the engine first"
        return self._streamer

    @property
    def models(self) -> ModelManager:
        assert self._manager is not None, "start the engine first"
        return self._manager

    @property
    def predictor(self) -> Predictor:
        """The default model's serving version's Predictor (``NotReady`` if none serves)."""
        version = self.registry.default
        if version is None or version.predictor is None:
            raise NotReady("no default model is serving")
        return version.predictor

    @property
    def queue_depth(self) -> int:
        """Requests waiting: in this process's queue, and (broker mode) in the shared one."""
        return self.streamer.queue_depth + self.transport.shared_queue_depth

    async def backlog(self) -> QueueBacklog:
        """The work waiting for model workers (``GET /backlog``): in broker mode every front
        end's, from Redis (the same figure from each); in-process, this server's queue (lag)
        and the batches its workers run (pending)."""
        shared = getattr(self.transport, "backlog", None)
        if shared is not None:
            counted: QueueBacklog = await shared()
            return counted
        return QueueBacklog(self.streamer.queue_depth, self.streamer.in_flight)

    async def refresh_routes(self) -> None:
        """Broker mode: look at the workers now (which versions serve), rather than wait for
        the front end's next look; a no-op for a transport that routes nothing."""
        refresh = getattr(self.transport, "refresh", None)
        if refresh is not None:
            await refresh()

    def labels(self, served_id: str) -> tuple[str, str]:
        """The ``model`` and ``version`` metric labels of a served id."""
        for version in self.registry.versions():
            if version.served_id == served_id:
                return version.name, str(version.version)
        return "", ""

    async def start(self) -> None:
        """Read the repository, start every worker with the versions to serve (raises
        ``StartupError`` with a clear message if one cannot start), then the Streamer and
        the models' predictors. Undoes what it started if any of that fails."""
        plan, metrics, limits = self.plan, self.metrics, self.plan.limits
        front_end = plan.role is Role.FRONT_END
        try:
            manager = self._manager = ModelManager(
                self.registry,
                repository_of(plan),
                None,
                self._predictor_for,
                dtype=plan.worker.dtype,
                drain_timeout_s=limits.request_timeout_s + 5,
                # A broker front end holds no weights: it needs each version's identity,
                # input size and class names only.
                roles=("classes",) if front_end else None,
                on_load=metrics.on_load if metrics else None,
            )
            chosen = manager.read_chosen()
            self._transport = self._given_transport or default_transport(
                plan,
                [item.spec for item in chosen],
                metrics,
                on_routes=manager.follow,
                labels=self.labels,
            )
            if not front_end:
                manager.host = self._host(self._transport)
            # The Streamer before the transport starts: a broker front end's first look at
            # the workers may already make predictors (their requests wait for the start).
            self._streamer = Streamer(
                self._transport.run_batch,
                max_batch_size=limits.max_batch_size,
                batch_size_for=self._transport.batch_size_for,
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
            await self._transport.start()
            if self._given_transport is not None and manager.host is not None:
                for item in chosen:  # a transport built elsewhere holds what serves too
                    await manager.host.load(item.spec)
            await self._streamer.start()
            if front_end:  # the workers' heartbeats say which versions serve (follow)
                self.registry.expect(item.spec.name for item in chosen)
            else:
                manager.serve_started(chosen)
        except BaseException:
            await self.aclose()
            raise
        log.info(
            "serving %s from %s, %s; decoding in %s",
            ", ".join(_described(item) for item in chosen),
            plan.repository.root,
            plan.describe(),
            plan.decode.describe(),
        )

    @staticmethod
    def _host(transport: Any) -> ModelHost | None:
        """The transport as a model host, if it loads models (the pool, a fake)."""
        loads = callable(getattr(transport, "load", None))
        return transport if loads and callable(getattr(transport, "unload", None)) else None

    def _predictor_for(self, manifest: Manifest, classes: list[str], served_id: str) -> Predictor:
        plan = self.plan
        return Predictor(
            self.streamer,
            manifest,
            classes,
            plan.decode,
            self._decode_pool,
            max_pixels=plan.worker.max_pixels,
            model_id=served_id,
        )

    def _on_batch(self, key: Hashable, size: int, waits: Sequence[float]) -> None:
        assert self.metrics is not None and isinstance(key, BatchKey)
        self.metrics.on_batch(key.task.value, size, waits, *self.labels(key.model))

    async def aclose(self) -> None:
        """Let admitted work finish (up to ``drain_timeout_s``), then stop everything.
        Idempotent."""
        if self._streamer is not None:
            await self._streamer.aclose(drain_timeout_s=self.drain_timeout_s)
        if self._manager is not None:
            await self._manager.aclose()
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


def _described(item: VersionOnDisk) -> str:
    return f"{item.spec.name} version {item.spec.version} ({item.spec.served_id})"
