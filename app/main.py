"""The ASGI application: ``create_app(settings)`` wires the settings, their serving plan
(``app.plan``), the engine and the routes.

Nothing happens at import. Serve it with ``python -m app``, or any ASGI server that can call
a factory: ``uvicorn --factory app.main:create_app``, or gunicorn with
``app.gunicorn_worker.Worker`` and ``'app.main:create_app()'``. Start-up order, in the ASGI
lifespan: read and verify the model repository, start the workers with every model (the
port opens once they are loaded and warmed up, so a broken model or device fails the start
with a clear message), then the Streamer. While it serves, ``kill -HUP`` (and
``MB_REPOSITORY_POLL_S``) loads what is new in the repository.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

from fastapi import FastAPI

from app import tracing
from app.background import Background
from app.batching import Transport
from app.engine import Engine, repository_of
from app.errors import SettingsError, StartupError
from app.jobs import ImageJob
from app.logs import configure_logging
from app.metrics import LiveState, Metrics, VersionState
from app.observability import RequestLog
from app.plan import Role, ServingPlan, plan_serving
from app.routers import meta, predict, repository, torchserve, v2
from app.routers.direct import DirectApp
from app.routers.errors import MULTIPART_OVERHEAD_BYTES, BodySizeLimit, install_error_handlers
from app.settings import Settings, get_settings
from app.tenancy import LocalBuckets, RedisBuckets, Scope, Tenancy

log = logging.getLogger("app")
signals = logging.getLogger("app.signals")  # an operator's signal: each one logged (app.logs)


def _flag_closing_on_signals(app: FastAPI) -> Callable[[], None]:
    """On SIGTERM/SIGINT, flip readiness to 503 and refuse new requests at once, then hand the
    signal to whoever handled it before (uvicorn, which drains admitted requests)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous: dict[int, Any] = {}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        app.state.closing = True
        engine = getattr(app.state, "engine", None)
        if engine is not None:  # an admin call waiting for the workers answers now
            engine.models.stop_waiting()
        handler = previous.get(signum)
        if callable(handler):
            handler(signum, frame)
        elif handler == signal.SIG_DFL:  # nobody else drains: take the default action
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.getsignal(sig)
        signal.signal(sig, on_signal)

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def _reload_on_hangup(engine: Engine, tenancy: Tenancy) -> Callable[[], None]:
    """``kill -HUP``: read the keys file again (``MB_KEYS_FILE``; one with an error keeps
    the keys in force), and load whatever is new in the model repository (retrying what
    failed), as the admin load route does: in-process, this server's workers; a broker front
    end's, every worker of the fleet. Returns the undo."""
    models = engine.models
    if not hasattr(signal, "SIGHUP"):
        return lambda: None
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    reloads = Background()

    def on_hangup() -> None:
        tenancy.reload()
        signals.info("SIGHUP: loading what is new in %s", engine.plan.repository.root)
        reloads.start(models.reload())

    loop.add_signal_handler(signal.SIGHUP, on_hangup)

    def undo() -> None:
        loop.remove_signal_handler(signal.SIGHUP)

    return undo


def _live_state(engine: Engine) -> LiveState:
    """The gauges' state: the versions as the index has them (a broker front end's include
    what its workers loaded, failed or gave up), with the serving ones' manifests."""
    workers = engine.transport.worker_status()
    manifests = {v.served_id: v.manifest for v in engine.registry.versions()}
    return LiveState(
        queue_depth=engine.queue_depth,
        in_flight=engine.streamer.in_flight,
        workers=workers,
        versions=[
            VersionState(
                row["name"],
                int(row["version"]),
                row["model_id"] or "",
                row["state"],
                manifests.get(row["model_id"]),
                row["serving"],
                row["runtime"],
                row["slowdown"],
            )
            for row in engine.models.index(workers)
            if row["state"] != "unavailable"
        ],
    )


def _shared_quota(
    plan: ServingPlan, metrics: Metrics
) -> Callable[[LocalBuckets], RedisBuckets] | None:
    """A broker front end draws quotas from Redis, shared with every other front end."""
    broker = plan.broker
    if plan.role is not Role.FRONT_END or broker is None:
        return None
    return lambda local: RedisBuckets.connect(
        broker.url, broker.prefix, local, metrics.on_quota_error
    )


def _freeze_startup_objects() -> Callable[[], None]:
    """Move every object alive after start-up out of the garbage collector's sight: the
    HTTP process holds hundreds of thousands of long-lived objects (FastAPI, pydantic, numpy,
    torch's Python side) that every full collection would walk again, though requests only
    make short-lived garbage. Returns the undo, for shutdown."""
    gc.collect()  # freeze only what is alive, not start-up's garbage
    gc.freeze()
    return gc.unfreeze


def _without_security(app: FastAPI, open_schemes: set[str]) -> None:
    """Drop from the OpenAPI docs the security schemes (``app.dependencies``' ``bearer``,
    ``metrics``) whose routes want no key: a request without one may use them."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schemes = schema.get("components", {}).get("securitySchemes", {})
            for name in open_schemes:
                schemes.pop(name, None)
            if not schemes:
                schema.get("components", {}).pop("securitySchemes", None)
            for operations in schema["paths"].values():
                for operation in operations.values():
                    kept = [s for s in operation.get("security", []) if not open_schemes & set(s)]
                    if kept:
                        operation["security"] = kept
                    else:
                        operation.pop("security", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(
    settings: Settings | None = None, *, transport: Transport[ImageJob] | None = None
) -> FastAPI:
    """Build the application from ``settings`` (default: the environment). Nothing starts
    until the ASGI lifespan runs. ``transport`` replaces the one the settings ask for (model
    workers here, or the broker): an ``app.testing.FakeTransport``, say. Exits with status 2
    and a message naming each bad setting when the environment is invalid (an ASGI server
    calling the factory has no better way to report it)."""
    if settings is None:
        try:
            settings = get_settings()
        except SettingsError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
    configure_logging(settings.log_level, settings.log_format)
    try:
        tracing.configure_once("server")  # OTEL_* (off when none asks for it)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        plan = plan_serving(settings)
        if transport is None:  # no model to serve: one line now, not a traceback later
            repository_of(plan).read_chosen(
                plan.worker.dtype,
                default=plan.repository.default_model,
                verify=False,
                roles=("classes",),
            )
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    metrics = Metrics(
        remote_workers=plan.remote_workers, multiprocess_dir=settings.prometheus_multiproc_dir
    )
    try:
        tenancy = Tenancy.of_settings(settings, metrics, _shared_quota(plan, metrics))
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        drain_s = plan.limits.request_timeout_s  # admitted requests may finish at shutdown
        async with Engine(
            plan, metrics, transport=transport, drain_timeout_s=drain_s, charge=tenancy.charge
        ) as engine:
            state = app.state
            state.engine = engine
            registry = engine.registry
            # X-Model-Id on an answer no model was admitted for: the default's serving id.
            state.default_model_id = lambda: registry.default and registry.default.served_id
            metrics.labels = engine.labels
            metrics.watch(lambda: _live_state(engine))
            restore_signals = _flag_closing_on_signals(app)
            stop_hangup = _reload_on_hangup(engine, tenancy)
            poll = None
            models = engine.models
            if plan.repository.poll_s is not None:
                poll = asyncio.create_task(models.poll(plan.repository.poll_s))
            grpc_server = None
            if settings.mb_grpc_port is not None:  # imported only when asked for
                from app.v2 import grpc_server as v2_grpc

                ready = lambda: engine.serves() and not app.state.closing  # noqa: E731
                grpc_server, port = await v2_grpc.start(
                    engine, settings, tenancy, ready, settings.host, settings.mb_grpc_port,
                    closing=lambda: app.state.closing,
                )  # fmt: skip
                state.grpc_port = port
                log.info("gRPC (Open Inference Protocol) on %s:%d", settings.host, port)
            unfreeze = _freeze_startup_objects()
            try:
                yield
            finally:
                unfreeze()
                if grpc_server is not None:  # calls in flight get the drain time HTTP gets
                    await grpc_server.stop(grace=drain_s)
                if poll is not None:
                    poll.cancel()
                stop_hangup()
                restore_signals()
                state.closing = True
                await tenancy.aclose()
        tracing.flush()  # the last requests' spans, before the process ends

    app = DirectApp(
        title="microbatch-server",
        summary="Micro-batching PyTorch image embedding and tagging server",
        version="0.1.0",
        lifespan=lifespan,
        # FastAPI's own OpenTelemetry hooks look up the global providers on every request;
        # this server traces its requests itself (app.tracing), at no cost when off.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.settings = settings
    app.state.plan = plan
    app.state.metrics = metrics
    app.state.tenancy = tenancy
    app.state.closing = False
    install_error_handlers(app, metrics)
    # Enforced while the body streams in (and from Content-Length before reading): an
    # oversized upload is never read whole. The exact file-size check is in the route.
    body_limit = settings.max_upload_bytes + MULTIPART_OVERHEAD_BYTES
    app.add_middleware(BodySizeLimit, max_body_bytes=body_limit, metrics=metrics)
    app.include_router(predict.router)
    app.include_router(meta.router)
    app.include_router(v2.router)
    app.include_router(v2.infer_router)
    app.include_router(repository.router)
    app.include_router(torchserve.predictions)
    app.include_router(torchserve.router)
    if settings.admin_api_key is not None or settings.mb_keys_file is not None:
        app.include_router(repository.admin)  # without a key for them, not there at all
    keyring = tenancy.keyring
    _without_security(
        app,
        {
            scheme
            for scheme, scope in (("bearer", Scope.INFER), ("metrics", Scope.METRICS))
            if not keyring.needs_key(scope)
        },
    )
    app.add_middleware(RequestLog, metrics=metrics)  # outermost: sees every request
    # The prediction routes, straight from the server, inside the middleware above.
    app.route_directly(
        [*predict.router.routes, *v2.infer_router.routes, *torchserve.predictions.routes]
    )
    return app
