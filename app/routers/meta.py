"""Health, readiness, metrics, what is being served, and class names."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from app.dependencies import (
    REQUIRES_METRICS_KEY,
    admitted,
    is_ready,
    readiness_response,
    running_engine,
    serving_engine,
)
from app.errors import NoClassifier
from app.schemas import Backlog, ErrorResponse, Health, Readiness, StreamBacklog, WorkerState

router = APIRouter(tags=["meta"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """Liveness: the process is up and its event loop answers."""
    return Health(status="ok")


def _workers(request: Request) -> list[WorkerState]:
    engine = running_engine(request)
    if engine is None:
        return []
    return [WorkerState(**asdict(status)) for status in engine.transport.worker_status()]


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
async def readyz(request: Request) -> JSONResponse:
    """Readiness: 200 while a model worker is ready and the server is not stopping, else 503."""
    engine = running_engine(request)
    ready = is_ready(request)
    body = Readiness(
        status="ready" if ready else "not_ready",
        queue_depth=engine.queue_depth if engine is not None else 0,
        in_flight=engine.streamer.in_flight if engine is not None else 0,
        workers=_workers(request),
    )
    return readiness_response(body.model_dump(), ready)


@router.get("/backlog", response_model=Backlog, responses={503: {"model": ErrorResponse}})
async def backlog(request: Request) -> Backlog:
    """The work waiting for model workers (for an autoscaler: KEDA's metrics-api trigger reads
    ``backlog``). Broker mode: lag + pending over every model version's streams, the same
    from every front end."""
    counted = await serving_engine(request).backlog()
    return Backlog(
        backlog=counted.backlog,
        lag=counted.lag,
        pending=counted.pending,
        streams=[StreamBacklog(**asdict(stream)) for stream in counted.streams],
    )


@router.get(
    "/metrics",
    response_class=Response,
    dependencies=REQUIRES_METRICS_KEY,
    responses={status: {"model": ErrorResponse} for status in (401, 403)},
)
async def metrics(request: Request) -> Response:
    """Prometheus metrics (text exposition format)."""
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/info")
async def info(request: Request) -> dict[str, Any]:
    """What is being served: every model and version (``models``), the default model's
    manifest (``model``, ``model_id``), the effective batching settings, the workers."""
    engine = serving_engine(request)
    plan, streamer = engine.plan, engine.streamer
    default = engine.registry.default
    return {
        "model_id": default.served_id if default is not None else None,
        "model": default.manifest.model_dump() if default and default.manifest else None,
        "default_model": default.name if default is not None else None,
        "models": engine.models.index(engine.transport.worker_status()),
        "batching": {
            "batch_size": engine.transport.batch_size,
            "batch_size_setting": plan.batch_size_setting,
            "max_latency_s": streamer.max_latency_s,
            "max_queue": streamer.max_queue_size,
            "request_timeout_s": plan.limits.request_timeout_s,
            "batch_timeout_s": plan.limits.batch_timeout_s,
            "dtype": (
                default.manifest.serving_dtype(plan.worker.dtype)
                if default and default.manifest
                else plan.worker.dtype
            ),
            "optimize": plan.worker.optimize,
            "decode": plan.decode.describe(),
            "transport": plan.describe(),
        },
        "workers": [worker.model_dump() for worker in _workers(request)],
    }


@router.get("/tags", response_model=list[str])
async def tags(request: Request) -> list[str]:
    """The class names the tagger can return, in the model's index order (``?model=NAME``
    chooses the model; 404 for an embedding-only model)."""
    async with admitted(request) as version:
        if version.predictor is None:
            raise NoClassifier(f"{version.label} has no classes")
        version.predictor.require_classifier()
        return version.predictor.classes
