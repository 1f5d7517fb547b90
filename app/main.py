"""The ASGI application: ``create_app(settings)`` wires settings, workers, Streamer and routes.

``uvicorn app.main:app`` serves the app built from the environment. Start-up order: verify
the model store, start the workers (the port opens once they are loaded and warmed up, so a
broken model or device fails the start with a clear message), then the Streamer.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from app.batching import Streamer
from app.errors import ServerError, SettingsError, Unavailable, http_status
from app.jobs import ImageJob
from app.manifest import read_classes, read_manifest
from app.routers import meta, predict
from app.services.predictor import Predictor
from app.settings import Settings, get_settings
from app.workers.pool import WorkerPool

log = logging.getLogger("app")


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"error": {"type": code, "message": message}}, status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServerError)
    async def server_error(request: Request, exc: ServerError) -> JSONResponse:
        headers = None
        if isinstance(exc, Unavailable):
            headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
        return error_response(http_status(exc), exc.code, exc.message, headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        return error_response(422, "invalid_request", problems)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal_error", "internal server error")


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the application. Nothing starts until the ASGI lifespan runs."""
    settings = settings or get_settings()
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=settings.log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        manifest = read_manifest(settings.model_store, verify=True)
        classes = read_classes(settings.model_store, manifest)
        pool = WorkerPool(
            model_store=settings.model_store,
            manifest=manifest,
            devices=settings.cuda_device_ids,
            worker_num=settings.mb_worker_num,
            threads_per_worker=settings.mb_worker_threads,
            max_batch_size=settings.mb_batch_size,
            start_timeout_s=settings.mb_worker_start_timeout,
        )
        await pool.start()
        streamer: Streamer[ImageJob, object] = Streamer(
            pool.run_batch,
            max_batch_size=settings.mb_batch_size,
            max_latency_s=settings.mb_max_latency,
            max_queue_size=settings.mb_max_queue,
            max_concurrent_batches=pool.capacity,
            default_timeout_s=settings.mb_request_timeout,
        )
        decode_pool = ThreadPoolExecutor(settings.mb_decode_threads, thread_name_prefix="decode")
        await streamer.start()
        app.state.pool, app.state.streamer = pool, streamer
        app.state.predictor = Predictor(
            streamer, manifest, classes, decode_pool, max_pixels=40_000_000
        )
        log.info(
            "serving %s from %s: batch<=%d, max latency %g s, %d worker(s)",
            manifest.arch,
            settings.model_store,
            settings.mb_batch_size,
            settings.mb_max_latency,
            pool.capacity,
        )
        try:
            yield
        finally:
            app.state.closing = True
            await streamer.aclose(drain_timeout_s=settings.mb_request_timeout)
            await pool.aclose()
            decode_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="microbatch-server",
        summary="Micro-batching PyTorch image embedding and tagging server",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.closing = False
    _install_error_handlers(app)
    app.include_router(predict.router)
    app.include_router(meta.router)
    return app


def _app_from_environment() -> FastAPI:
    try:
        return create_app()
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


app = _app_from_environment()
