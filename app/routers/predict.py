"""Prediction endpoints."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from app import tracing
from app.dependencies import (
    REQUIRES_API_KEY,
    admitted,
    app_settings,
    cache_use_of,
    header,
    query_param,
    ticket_of,
)
from app.errors import InvalidRequest
from app.jsonbody import JsonBody
from app.routers.common import ERRORS, batch_trace, request_deadline, unless_disconnected
from app.routers.direct import DirectRoute
from app.routers.uploads import FILE_FIELD, Upload, read_upload
from app.schemas import TagOut
from app.services.predictor import DEFAULT_K, MAX_K, Predictor, parse_k
from app.services.registry import ModelVersion
from app.settings_values import MODEL_NAME_PATTERN

router = APIRouter(
    prefix="/predict", tags=["predict"], route_class=DirectRoute, dependencies=REQUIRES_API_KEY
)

K_HELP = (
    f"how many labels to return (default {DEFAULT_K}, or the class count of a model with fewer)"
)
SHAPE_HEADER = "X-Embedding-Shape"
EMBEDDING_BYTES_HELP = (
    "with Accept: application/octet-stream: the embeddings as raw little-endian float32, "
    f"rows in image order; their shape in the {SHAPE_HEADER} header ('1280', or '3,1280' "
    "for several images)"
)


# How a request chooses its model, for the OpenAPI docs (app.dependencies.admitted reads it).
# The X-Model-Id request header is documented in each route's description instead: declared as
# a header parameter, it made schemathesis take the configured API key for a generated one.
MODEL_PARAMETERS: list[dict[str, Any]] = [
    {
        "name": "model",
        "in": "query",
        "required": False,
        "description": "the model's name (default: the only one, or MB_DEFAULT_MODEL)",
        "schema": {"type": "string", "pattern": MODEL_NAME_PATTERN},
    },
]


def _upload_body(*, with_k: bool) -> dict[str, Any]:
    """OpenAPI for the body (and query) the routes read themselves."""
    image = {
        "type": "string",
        "format": "binary",
        "description": "the image (JPEG, PNG, WebP, BMP or GIF)",
    }
    images = {
        "type": "array",
        "items": image,
        "minItems": 1,
        "description": "one image, or the field repeated for several (answered as a list)",
    }
    form: dict[str, Any] = {
        "type": "object",
        "properties": {FILE_FIELD: images},
        "required": [FILE_FIELD],
    }
    k_schema = {"type": "integer", "minimum": 1, "maximum": MAX_K}
    if with_k:
        form["properties"]["k"] = {
            **k_schema,
            "description": f"{K_HELP} (or the query parameter k)",
        }
    k_query = {
        "name": "k",
        "in": "query",
        "required": False,
        "description": f"{K_HELP} (or the form field k, with the same value)",
        "schema": k_schema,
    }
    return {
        "parameters": [*MODEL_PARAMETERS, *([k_query] if with_k else [])],
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {"schema": form},
                "image/*": {"schema": image},
                "application/octet-stream": {"schema": image},
            },
        },
    }


async def _upload(request: Request, version: ModelVersion) -> tuple[Upload, float]:
    """The deadline and the queue's room first (cheap refusals; the API key and the model
    were checked before), then the upload."""
    settings = app_settings(request)
    deadline = request_deadline(request, settings.mb_request_timeout)
    _predictor(version.predictor).check_admission(ticket_of(request))
    with tracing.span("read upload"):
        upload = await read_upload(
            request, settings.max_upload_bytes, max_images=settings.max_images_per_request
        )
    return upload, deadline


def _predictor(predictor: Predictor | None) -> Predictor:
    assert predictor is not None, "a serving version has its predictor"
    return predictor


def _wants_binary(request: Request) -> bool:
    return "application/octet-stream" in (header(request, "accept") or "")


@router.post(
    "/embedding",
    response_model=list[float] | list[list[float]],
    responses={
        **ERRORS,
        200: {
            "content": {
                "application/octet-stream": {
                    "schema": {"type": "string", "format": "binary"},
                    "description": EMBEDDING_BYTES_HELP,
                }
            }
        },
    },
    openapi_extra=_upload_body(with_k=False),
)
async def embedding(request: Request) -> Response:
    """Embed images: each one's pooled feature vector (a list of floats; a list of them for
    several images, in order; raw float32 with ``Accept: application/octet-stream``).
    ``?model=NAME`` chooses the model; ``X-Model-Id`` pins the exact export."""
    async with admitted(request) as version:
        upload, deadline = await _upload(request, version)
        with batch_trace(request) as trace:
            predictor = _predictor(version.predictor)
            vectors = await unless_disconnected(
                request,
                predictor.embeddings(
                    upload.data,
                    deadline,
                    trace,
                    names=upload.names,
                    ticket=ticket_of(request),
                    cache=cache_use_of(request),
                ),
            )
    with tracing.span("encode"):
        if _wants_binary(request):
            shape = vectors.shape if upload.several else vectors.shape[1:]
            return Response(
                vectors.astype("<f4").tobytes(),
                media_type="application/octet-stream",
                headers={SHAPE_HEADER: ",".join(map(str, shape))},
            )
        return JsonBody(vectors if upload.several else vectors[0])


def _one_k(form: str | None, query: str | None) -> int | None:
    """``k`` from the form field or the query parameter, each checked; both may be given
    only with the same value."""
    form_k, query_k = parse_k(form), parse_k(query)
    if form_k is not None and query_k is not None and form_k != query_k:
        raise InvalidRequest(
            f"k is given twice, {form_k} in the form and {query_k} in the query: give it once"
        )
    return form_k if form_k is not None else query_k


@router.post(
    "/tag",
    response_model=list[TagOut] | list[list[TagOut]],
    responses=ERRORS,
    openapi_extra=_upload_body(with_k=True),
)
async def tag(request: Request) -> JsonBody:
    """Tag images: the top-k class names with their probabilities, most probable first (a
    list of such lists for several images, in order). ``?model=NAME`` chooses the model;
    ``X-Model-Id`` pins the exact export."""
    async with admitted(request) as version:
        upload, deadline = await _upload(request, version)
        top_k = _one_k(upload.fields.get("k"), query_param(request, "k"))
        with batch_trace(request) as trace:
            predictor = _predictor(version.predictor)
            answers = await unless_disconnected(
                request,
                predictor.tags(
                    upload.data,
                    top_k,
                    deadline,
                    trace,
                    names=upload.names,
                    ticket=ticket_of(request),
                    cache=cache_use_of(request),
                ),
            )
    with tracing.span("encode"):
        shaped = [[{"name": t.name, "prob": t.prob} for t in tags] for tags in answers]
        return JsonBody(shaped if upload.several else shaped[0])
