"""The serving engine shared by the HTTP server and the batch job: read the model repository,
start a transport (the model workers, or the broker) with the versions to serve, put a
Streamer in front of it, and the model registry and its manager on top, one Predictor per
serving version; and stop it all again. The only module that wires those pieces together."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, asynccontextmanager
from types import TracebackType

from app import tracing
from app.batching import ClusterView, LevelPolicy, QueueBacklog, Streamer, Transport
from app.cache import ResponseCache
from app.errors import NotReady
from app.jobs import BatchKey, ImageJob
from app.lifecycle import ModelSpec, Route
from app.manifest import Manifest
from app.metrics import BatchRun, Metrics
from app.plan import Role, ServingPlan
from app.repository import Repository, VersionOnDisk
from app.services.models import Models
from app.services.predictor import Charge, Predictor
from app.services.registry import ModelRegistry, ModelVersion

log = logging.getLogger("app")


def repository_of(plan: ServingPlan) -> Repository:
    """The model repository the plan names: a repository, or a lone store as one."""
    return Repository.of_plan(plan.repository)


def default_transport(
    plan: ServingPlan,
    models: Sequence[ModelSpec],
    metrics: Metrics | None = None,
    *,
    labels: Callable[[str], tuple[str, str]] = lambda served_id: (served_id, ""),
) -> Transport[ImageJob]:
    """The transport the plan asks for (not started yet): model worker processes on this
    machine (their buffers sized for ``models``' images), or, for a broker front end, the
    workers behind Redis. Either loads what its ``models`` control is attached to."""
    if plan.role is Role.FRONT_END:
        assert plan.broker is not None
        from app.broker.front.transport import BrokerTransport  # no redis client unless asked for

        return BrokerTransport(
            plan.broker.url,
            plan.broker.prefix,
            max_queue=plan.limits.max_queue,
            switch_min_workers=plan.repository.switch_min_workers,
            on_workers=metrics.on_workers if metrics else None,
            scale_from_zero=plan.broker.scale_from_zero,
            own_routes={model.name: Route(model.version, model.served_id) for model in models},
            admin_url=plan.broker.admin_url,
            on_event=metrics.on_broker_event if metrics else None,
            levels=level_policies(plan),
            tenant_lanes=plan.broker.tenant_lanes,
        )
    from app.workers.pool import WorkerPool

    def on_run(run: BatchRun) -> None:
        assert metrics is not None
        metrics.on_run(run, *labels(run.model))

    return WorkerPool(
        models,
        plan,
        on_run=on_run if metrics else None,
        on_load=metrics.on_load if metrics else None,
    )


def level_policies(plan: ServingPlan) -> list[LevelPolicy]:
    """``MB_PRIORITY_LEVELS`` as the batching layer takes it (the same fields: batching
    reads no settings)."""
    return [LevelPolicy(**level.model_dump()) for level in plan.limits.levels]


def models_to_serve(plan: ServingPlan) -> list[ModelSpec]:
    """The version of each model a process started with ``plan`` serves first (for a
    transport built outside the engine, as tests do)."""
    return [item.spec for item in repository_of(plan).read_chosen(plan.worker.dtype, verify=False)]


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
        charge: Charge | None = None,
    ) -> None:
        self.plan = plan
        self._charge = charge  # each request's quota (app.tenancy), for the Predictors
        self.metrics = metrics
        self.drain_timeout_s = drain_timeout_s  # how long closing lets admitted work finish
        self._given_transport = transport
        self._decode_pool: ThreadPoolExecutor | None = None
        self._transport: Transport[ImageJob] | None = None
        self._streamer: Streamer[ImageJob, object] | None = None
        self.cache: ResponseCache | None = None  # MB_CACHE_BYTES, MB_CACHE_REDIS
        self.registry = ModelRegistry(plan.repository.default_model)
        self._manager: Models | None = None

    @property
    def transport(self) -> Transport[ImageJob]:
        assert self._transport is not None, "start the engine first"
        return self._transport

    @property
    def streamer(self) -> Streamer[ImageJob, object]:
        assert self._streamer is not None, "start the engine first"
        return self._streamer

    @property
    def models(self) -> Models:
        """The models served, as the workers hold them (``app.services.models``)."""
        assert self._manager is not None, "start the engine first"
        return self._manager

    @property
    def predictor(self) -> Predictor:
        """The default model's serving version's Predictor (``NotReady`` if none serves)."""
        version = self.registry.default
        if version is None or version.predictor is None:
            raise NotReady("no default model is serving")
        return version.predictor

    def serves(self) -> bool:
        """Whether this process can answer: a model worker is ready, a model version
        serves, and every name's serving version is held by a ready worker (a switch is
        only ever to such a version; a worker that died takes its hold with it)."""
        names = self.registry.names()
        return bool(names) and all(
            version is not None and self.answers_for(version)
            for version in (self.registry.serving(name) for name in names)
        )

    def answers_for(self, version: ModelVersion) -> bool:
        """Whether ``version`` is ready for requests: it serves its name and a ready
        worker holds it (``serves`` asks this of every name)."""
        if not self.transport.ready or self.registry.serving(version.name) is not version:
            return False
        return self.transport.models.view.answers(version.served_id)

    @property
    def queue_depth(self) -> int:
        """Requests waiting: in this process's queue, and (broker mode) in the shared one."""
        return self.streamer.queue_depth + self.transport.shared_queue_depth

    async def backlog(self) -> QueueBacklog:
        """The work waiting for model workers (``GET /backlog``): in broker mode every front
        end's, from Redis (the same figure from each); in-process, this server's queue (lag)
        and the batches its workers run (pending)."""
        shared = await self.transport.backlog()
        if shared is not None:
            return shared
        return QueueBacklog(self.streamer.queue_depth, self.streamer.in_flight)

    async def refresh_routes(self) -> None:
        """Broker mode: look at the workers now (which versions serve), rather than wait for
        the front end's next look; a no-op for a transport that routes nothing."""
        await self.transport.refresh()

    @asynccontextmanager
    async def admitted(
        self, name: str | None, pinned: str | None = None, number: str | None = None
    ) -> AsyncIterator[ModelVersion]:
        """The model version a request gets, resolved once, now (``ModelRegistry.admit``:
        ``name`` or the default, an exact served id ``pinned``, or a version ``number``),
        held until the block ends so it is not unloaded under the request. A broker front
        end that knows the model but has seen no worker serve it looks at the workers again
        first (they may have come since its last look)."""
        with ExitStack() as held:
            with tracing.span("admission"):
                try:
                    self.registry.resolve(name, pinned, number)
                except NotReady:
                    await self.refresh_routes()
                version = held.enter_context(self.registry.admit(name, pinned, number))
            yield version

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
        plan, limits = self.plan, self.plan.limits
        front_end = plan.role is Role.FRONT_END
        repository = repository_of(plan)
        try:
            self.cache = self._response_cache()  # before any Predictor is made
            # A broker front end holds no weights: it needs each version's identity, input
            # size and class names only.
            chosen = repository.read_chosen(
                plan.worker.dtype,
                default=plan.repository.default_model,
                roles=("classes",) if front_end else None,
            )
            self._transport = self._given_transport or default_transport(
                plan, [item.spec for item in chosen], self.metrics, labels=self.labels
            )
            control = self._transport.models
            control.attach(repository, plan.worker.dtype, self._follow, self.registry.in_use)
            self._manager = Models(
                self.registry, repository, control, self._predictor_for,
                dtype=plan.worker.dtype, drain_timeout_s=plan.limits.request_timeout_s + 5,
                load_timeout_s=plan.limits.start_timeout_s,
                min_workers=plan.repository.switch_min_workers, in_place=not front_end,
            )  # fmt: skip
            # The Streamer before the transport starts: its first view of the workers may
            # already make predictors (their requests wait for the start).
            self._streamer = Streamer(
                self._transport.run_batch,
                max_batch_size=limits.max_batch_size,
                batch_size_for=self._transport.batch_size_for,
                max_latency_s=limits.max_latency_s,
                max_queue_size=limits.max_queue,
                max_concurrent_batches=self._transport.capacity,
                default_timeout_s=limits.request_timeout_s,
                on_batch=self._on_batch if self.metrics and not plan.remote_workers else None,
                levels=level_policies(plan),
            )
            if plan.decode.server_threads:
                self._decode_pool = ThreadPoolExecutor(
                    plan.decode.server_threads, thread_name_prefix="decode"
                )
            # Until the workers say they serve a name, a request for it gets 503, not 404.
            self.registry.expect(item.spec.name for item in chosen)
            await self._transport.start()  # in-process: every worker loads its models
            await self._streamer.start()
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

    def _response_cache(self) -> ResponseCache | None:
        """The response cache the plan asks for (``app.cache``), or None."""
        plan, metrics = self.plan.cache, self.metrics
        if not plan.on:
            return None
        shared = None
        if plan.redis_url is not None:
            from app.cache.shared import SharedCache  # no redis client unless asked for

            shared = SharedCache.connect(
                plan.redis_url, plan.prefix, plan.ttl_s,
                metrics.on_cache_error if metrics else lambda: None,
            )  # fmt: skip
        if metrics is None:
            return ResponseCache(plan.max_bytes, shared)
        cache = ResponseCache(plan.max_bytes, shared, metrics.on_cache, metrics.on_cache_evict)
        metrics.watch_cache(cache)
        return cache

    def _follow(self, view: ClusterView) -> None:
        """Each new view of the workers: the models served follow them."""
        if self._manager is not None:
            self._manager.follow(view)

    def _predictor_for(self, manifest: Manifest, classes: list[str], served_id: str) -> Predictor:
        plan = self.plan
        return Predictor(
            self.streamer,
            manifest,
            classes,
            plan.decode,
            self._decode_pool,
            max_pixels=plan.worker.max_pixels,
            max_bytes=plan.limits.max_image_bytes,
            model_id=served_id,
            charge=self._charge,
            cache=self.cache,
        )

    def _on_batch(
        self, key: Hashable, size: int, waits: Sequence[float], tenants: Sequence[Hashable]
    ) -> None:
        assert self.metrics is not None and isinstance(key, BatchKey)
        self.metrics.on_batch(key.task.value, size, waits, *self.labels(key.model))
        self.metrics.on_tenant_waits(waits, tenants)

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
        if self.cache is not None:
            await self.cache.aclose()
            self.cache = None

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
