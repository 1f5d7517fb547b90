"""The Open Inference Protocol (KServe v2) where it fits: health, model metadata and
readiness for KServe, Seldon and Triton-style probes and clients, and a small ``infer``.

Covered: ``GET /v2``, ``/v2/health/live``, ``/v2/health/ready``, ``/v2/models/{name}``,
``/v2/models/{name}/ready`` and ``POST /v2/models/{name}/infer`` (each also under
``/v2/models/{name}/versions/{version}``: the version's number, or its served id's version
part; 409 ``model_version_unavailable`` if it is not the one serving) over JSON, with one input
``image`` of datatype ``BYTES`` (each element an encoded image as base64: JSON has no
bytes) and the outputs ``embedding`` (FP32 ``[n, dim]``) and, for models with a classifier,
``top_k_probs`` (FP32 ``[n, k]``) and ``top_k_indices`` (INT64 ``[n, k]``; ``k`` from the
request's ``parameters``: 5 by default, or every class of a model with fewer). The model
repository extension is in ``app.routers.repository``. Not covered: the binary-data and
statistics extensions, and the gRPC protocol. Errors keep this server's own JSON shape.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from app.dependencies import (
    REQUIRES_API_KEY,
    SettingsDep,
    admitted,
    is_ready,
    readiness_response,
)
from app.errors import InvalidRequest, PayloadTooLarge
from app.routers.common import (
    ERRORS,
    batch_trace,
    parse_k,
    request_deadline,
    unless_disconnected,
)
from app.services.registry import ModelVersion

router = APIRouter(prefix="/v2", tags=["open inference protocol (v2)"])
VERSIONED = "/models/{name}/versions/{version}"

INPUT = "image"


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


class InferInput(BaseModel):
    name: Literal["image"]
    datatype: Literal["BYTES"]
    shape: list[int] = Field(min_length=1, max_length=1)
    data: list[str] = Field(min_length=1, description="each an encoded image, base64")


class RequestedOutput(BaseModel):
    name: Literal["embedding", "top_k_probs", "top_k_indices"]


class InferRequest(BaseModel):
    id: str | None = Field(None, max_length=128)
    inputs: list[InferInput] = Field(min_length=1, max_length=1)
    outputs: list[RequestedOutput] | None = None
    parameters: dict[str, Any] | None = None


class InferOutput(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    data: list[float] | list[int]


class InferResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[InferOutput]


@router.get("")
async def server_metadata() -> dict[str, Any]:
    """Server metadata: name, version and the protocol extensions supported (none)."""
    return {"name": "microbatch-server", "version": "0.1.0", "extensions": []}


@router.get("/health/live")
async def live() -> dict[str, bool]:
    """Liveness: 200 while the process is up."""
    return {"live": True}


@router.get("/health/ready", responses={503: {"description": "not ready"}})
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 while a model worker is ready and the server is not stopping."""
    ready = is_ready(request)
    return readiness_response({"ready": ready}, ready)


def _metadata(version: ModelVersion) -> ModelMetadata:
    manifest = version.manifest
    assert manifest is not None, "a serving version has its manifest"
    outputs = [TensorSpec(name="embedding", datatype="FP32", shape=[-1, manifest.embedding_dim])]
    if manifest.has_classifier:
        outputs += [
            TensorSpec(name="top_k_probs", datatype="FP32", shape=[-1, -1]),
            TensorSpec(name="top_k_indices", datatype="INT64", shape=[-1, -1]),
        ]
    return ModelMetadata(
        name=version.name,
        versions=[str(version.version)],
        platform="pytorch_torchscript",
        inputs=[TensorSpec(name=INPUT, datatype="BYTES", shape=[-1])],
        outputs=outputs,
    )


@router.get("/models/{name}", response_model=ModelMetadata, responses=ERRORS)
@router.get(VERSIONED, response_model=ModelMetadata, responses=ERRORS)
async def model_metadata(name: str, request: Request, version: str | None = None) -> ModelMetadata:
    """A served model: the version serving (its number), its input and outputs."""
    async with admitted(request, name, version) as served:
        return _metadata(served)


@router.get("/models/{name}/ready", responses={**ERRORS, 503: {"description": "not ready"}})
@router.get(VERSIONED + "/ready", responses={**ERRORS, 503: {"description": "not ready"}})
async def model_ready(name: str, request: Request, version: str | None = None) -> JSONResponse:
    """The model's readiness (or that version's): 200 while it serves and a worker is ready,
    503 while not; 409 ``model_version_unavailable`` for a version that is not the one
    serving, 404 for a name not served."""
    body: dict[str, Any] = {"name": name, "ready": False}
    async with admitted(request, name, version) as served:
        body.update(version=str(served.version), ready=is_ready(request))
    return readiness_response(body, body["ready"])


@router.post(
    "/models/{name}/infer",
    response_model=InferResponse,
    responses=ERRORS,
    dependencies=REQUIRES_API_KEY,
)
@router.post(
    VERSIONED + "/infer",
    response_model=InferResponse,
    responses=ERRORS,
    dependencies=REQUIRES_API_KEY,
)
async def infer(
    name: str,
    body: InferRequest,
    request: Request,
    settings: SettingsDep,
    version: str | None = None,
) -> InferResponse:
    """Embed and/or tag base64-encoded images, as the Open Inference Protocol asks; each
    image runs through the model once, whichever outputs are asked."""
    (given,) = body.inputs
    if given.shape != [len(given.data)]:
        raise InvalidRequest(
            f"input shape {given.shape} does not match its {len(given.data)} elements"
        )
    if len(given.data) > settings.max_images_per_request:
        raise PayloadTooLarge(f"at most {settings.max_images_per_request} images per request")
    images = [_image(index, text) for index, text in enumerate(given.data)]
    wanted = [output.name for output in body.outputs] if body.outputs else ["embedding"]
    top_k = bool({"top_k_probs", "top_k_indices"} & set(wanted))
    k = parse_k((body.parameters or {}).get("k"), "parameters.k") if top_k else None
    deadline = request_deadline(request, settings.mb_request_timeout)
    outputs: list[InferOutput] = []
    async with admitted(request, name, version) as served:
        assert served.predictor is not None
        with batch_trace(request) as trace:
            inferred = await unless_disconnected(
                request,
                served.predictor.infer(
                    images, k, deadline, trace, embedding="embedding" in wanted, top_k=top_k
                ),
            )
    if inferred.embeddings is not None:
        outputs.append(_output("embedding", "FP32", inferred.embeddings))
    top = inferred.top_k
    if top is not None and "top_k_probs" in wanted:
        outputs.append(_output("top_k_probs", "FP32", np.stack([t.probs for t in top])))
    if top is not None and "top_k_indices" in wanted:
        outputs.append(_output("top_k_indices", "INT64", np.stack([t.indices for t in top])))
    return InferResponse(
        model_name=served.name, model_version=str(served.version), id=body.id, outputs=outputs
    )


def _image(index: int, text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"input element {index} is not base64") from None


def _output(name: str, datatype: str, array: npt.NDArray[Any]) -> InferOutput:
    return InferOutput(
        name=name, datatype=datatype, shape=list(array.shape), data=array.reshape(-1).tolist()
    )
