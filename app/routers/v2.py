"""The Open Inference Protocol (KServe v2) over HTTP, as Triton's and KServe's clients speak
it: health, server and model metadata, readiness, ``infer`` (JSON, or with the binary tensor
data extension), and the classification, model configuration and statistics extensions. The
model repository extension is in ``app.routers.repository``; what an ``infer`` takes and
answers is in ``app.v2.inference``, the same for gRPC (``app.v2.grpc``).

Every model route is also under ``/v2/models/{name}/versions/{version}`` (the version's
number, or its served id's version part; 409 ``model_version_unavailable`` if it is not the
one serving). Errors answer ``{"error": "<message>", "type": "<this server's type>"}``, the
protocol's shape (``app.routers.errors``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from app import tracing
from app.dependencies import (
    REQUIRES_API_KEY,
    REQUIRES_METRICS_KEY,
    admitted,
    app_settings,
    cache_use_of,
    header,
    is_model_ready,
    is_ready,
    readiness_response,
    serving_engine,
    ticket_of,
)
from app.routers.common import V2_ERRORS, batch_trace, request_deadline, unless_disconnected
from app.routers.direct import DirectRoute
from app.routers.errors import MULTIPART_OVERHEAD_BYTES
from app.tenancy import TOP_PRIORITY
from app.v2 import http_body, inference
from app.v2.http_body import BINARY_TYPE, HEADER_LENGTH, JSON_TYPE, InferBody, inlined_schema
from app.v2.inference import PRIORITY_PARAMETER
from app.v2.server import EXTENSIONS, SERVER, config_of, statistics_of

router = APIRouter(prefix="/v2", tags=["open inference protocol (v2)"])
VERSIONED = "/models/{name}/versions/{version}"


class TensorSpec(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


class InferOutput(TensorSpec):
    data: list[Any] | None = None
    parameters: dict[str, Any] | None = None


class InferResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[InferOutput]


# The body is read by hand whatever its Content-Type, so OpenAPI learns its shape from here.
INFER_BODY = {
    "requestBody": {
        "required": True,
        "content": {JSON_TYPE: {"schema": inlined_schema(InferBody)}},
    }
}


@router.get("")
async def server_metadata() -> dict[str, Any]:
    """Server metadata: name, version and the protocol extensions implemented."""
    return {**SERVER, "extensions": EXTENSIONS}


@router.get("/health/live")
async def live() -> dict[str, bool]:
    """Liveness: 200 while the process is up."""
    return {"live": True}


@router.get("/health/ready", responses={503: {"description": "not ready"}})
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 while a model worker is ready and the server is not stopping."""
    ready = is_ready(request)
    return readiness_response({"ready": ready}, ready)


@router.get("/models/stats", responses=V2_ERRORS, dependencies=REQUIRES_METRICS_KEY)
async def all_statistics(request: Request) -> dict[str, Any]:
    """Cumulative statistics of every model version (Triton's statistics extension)."""
    return {"model_stats": statistics_of(serving_engine(request), None, None)}


@router.get("/models/{name}/stats", responses=V2_ERRORS, dependencies=REQUIRES_METRICS_KEY)
@router.get(VERSIONED + "/stats", responses=V2_ERRORS, dependencies=REQUIRES_METRICS_KEY)
async def statistics(name: str, request: Request, version: str | None = None) -> dict[str, Any]:
    """Cumulative statistics of a model's versions, or of one (``app.metrics.statistics``)."""
    return {"model_stats": statistics_of(serving_engine(request), name, version)}


@router.get("/models/{name}", response_model=ModelMetadata, responses=V2_ERRORS)
@router.get(VERSIONED, response_model=ModelMetadata, responses=V2_ERRORS)
async def model_metadata(name: str, request: Request, version: str | None = None) -> Any:
    """A served model: the version serving (its number), its inputs and outputs."""
    async with admitted(request, name, version) as served:
        return inference.metadata(served)


@router.get("/models/{name}/config", responses=V2_ERRORS)
@router.get(VERSIONED + "/config", responses=V2_ERRORS)
async def config(name: str, request: Request, version: str | None = None) -> dict[str, Any]:
    """The serving version's configuration in Triton's form: batch cap and wait, inputs,
    outputs and instance groups (Triton's model configuration extension)."""
    async with admitted(request, name, version) as served:
        return config_of(serving_engine(request), served)


@router.get("/models/{name}/ready", responses={**V2_ERRORS, 503: {"description": "not ready"}})
@router.get(VERSIONED + "/ready", responses={**V2_ERRORS, 503: {"description": "not ready"}})
async def model_ready(name: str, request: Request, version: str | None = None) -> JSONResponse:
    """The model's readiness (or that version's): 200 while it serves and a worker is ready,
    503 while not; 409 ``model_version_unavailable`` for a version that is not the one
    serving, 404 for a name not served."""
    body: dict[str, Any] = {"name": name, "ready": False}
    async with admitted(request, name, version) as served:
        body.update(version=str(served.version), ready=is_model_ready(request, served))
    return readiness_response(body, body["ready"])


# infer resolves nothing per request (a DirectRoute: its FastAPI dependency resolution cost
# about what the multipart parse /predict avoids), so OpenAPI learns its path from here too.
def _path(*names: str) -> list[dict[str, Any]]:
    return [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in names
    ]


infer_router = APIRouter(
    prefix="/v2",
    tags=["open inference protocol (v2)"],
    route_class=DirectRoute,
    dependencies=REQUIRES_API_KEY,
)


@infer_router.post(
    "/models/{name}/infer",
    response_model=InferResponse,
    responses=V2_ERRORS,
    openapi_extra={**INFER_BODY, "parameters": _path("name")},
)
@infer_router.post(
    VERSIONED + "/infer",
    response_model=InferResponse,
    responses=V2_ERRORS,
    openapi_extra={**INFER_BODY, "parameters": _path("name", "version")},
)
async def infer(request: Request) -> Response:
    """Embed and/or tag images (encoded, or preprocessed FP32), as the Open Inference
    Protocol asks; each image runs through the model once, whichever outputs are asked."""
    settings = app_settings(request)
    name, version = request.path_params["name"], request.path_params.get("version")
    async with admitted(request, name, version) as served:
        if served.predictor is not None:  # a full queue refuses before the body is read:
            # at the most urgent priority this caller may ask (the body may ask it)
            served.predictor.check_admission(ticket_of(request, TOP_PRIORITY))
        with tracing.span("read upload"):
            limit = settings.max_upload_bytes + MULTIPART_OVERHEAD_BYTES  # as a plain body's
            raw = http_body.decoded(
                await request.body(), header(request, "Content-Encoding"), limit
            )
            body, call = http_body.parse(raw, header(request, HEADER_LENGTH))
        deadline = inference.shortened(
            request_deadline(request, settings.mb_request_timeout), call.parameters
        )
        head = {"model_name": served.name, "model_version": str(served.version)}  # as admitted
        with batch_trace(request) as trace:
            outputs = await inference.infer(
                served,
                call,
                deadline,
                trace,
                max_images=settings.max_images_per_request,
                wait=lambda work: unless_disconnected(request, work),
                ticket=ticket_of(request, call.parameters.get("priority"), PRIORITY_PARAMETER),
                cache=cache_use_of(request),
            )
    if body.id is not None:
        head["id"] = body.id
    content, json_length = http_body.answer(body, outputs, head)
    if json_length is None:
        return Response(content, media_type=JSON_TYPE)
    return Response(content, media_type=BINARY_TYPE, headers={HEADER_LENGTH: str(json_length)})
