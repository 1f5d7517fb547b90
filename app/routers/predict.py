"""Prediction endpoints."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from app.dependencies import app_settings, require_api_key, serving_predictor
from app.errors import InvalidRequest
from app.routers.common import batch_trace, request_deadline, unless_disconnected
from app.routers.direct import DirectRoute
from app.routers.uploads import FILE_FIELD, Upload, read_upload
from app.schemas import ErrorResponse, TagOut
from app.services.predictor import Predictor

router = APIRouter(prefix="/predict", tags=["predict"], route_class=DirectRoute)

ERRORS: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 413, 415, 422, 503, 504)
}
MAX_K = 1000
K_HELP = "how many labels to return"


def _upload_body(*, with_k: bool) -> dict[str, Any]:
    """OpenAPI for the body (and query) the routes read themselves."""
    image = {
        "type": "string",
        "format": "binary",
        "description": "the image (JPEG, PNG, WebP, BMP or GIF)",
    }
    form: dict[str, Any] = {
        "type": "object",
        "properties": {FILE_FIELD: image},
        "required": [FILE_FIELD],
    }
    k_schema = {"type": "integer", "minimum": 1, "maximum": MAX_K, "default": 5}
    if with_k:
        form["properties"]["k"] = {
            **k_schema,
            "description": f"{K_HELP} (or the query parameter k)",
        }
    k_query = {
        "name": "k",
        "in": "query",
        "required": False,
        "description": f"{K_HELP} (a form field k wins)",
        "schema": k_schema,
    }
    return {
        "parameters": [k_query] if with_k else [],
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {"schema": form},
                "image/*": {"schema": image},
                "application/octet-stream": {"schema": image},
            },
        },
    }


def _k(form_value: str | None, query_value: str | None) -> int:
    """``k`` from the form field, else the query, else 5; 422 unless 1 <= k <= MAX_K."""
    value = form_value if form_value is not None else query_value
    if value is None:
        return 5
    try:
        k = int(value)
    except ValueError:
        raise InvalidRequest(f"k must be an integer, got {value[:20]!r}") from None
    if not 1 <= k <= MAX_K:
        raise InvalidRequest(f"k must be between 1 and {MAX_K}, got {k}")
    return k


async def _admit(request: Request) -> tuple[Predictor, Upload, float]:
    """API key, readiness and deadline first (cheap refusals), then the upload."""
    settings = app_settings(request)
    require_api_key(request, settings)
    predictor = serving_predictor(request)
    deadline = request_deadline(request, settings.mb_request_timeout)
    return predictor, await read_upload(request, settings.max_upload_bytes), deadline


@router.post(
    "/embedding",
    response_model=list[float],
    responses=ERRORS,
    openapi_extra=_upload_body(with_k=False),
)
async def embedding(request: Request) -> JSONResponse:
    """Embed one image: the model's pooled feature vector as a list of floats."""
    predictor, upload, deadline = await _admit(request)
    with batch_trace(request) as trace:
        vector = await unless_disconnected(
            request, predictor.embedding(upload.data, deadline, trace)
        )
    return JSONResponse(vector)


@router.post(
    "/tag", response_model=list[TagOut], responses=ERRORS, openapi_extra=_upload_body(with_k=True)
)
async def tag(request: Request) -> JSONResponse:
    """Tag one image: the top-k class names with their probabilities, most probable first."""
    predictor, upload, deadline = await _admit(request)
    top_k = _k(upload.fields.get("k"), request.query_params.get("k"))
    with batch_trace(request) as trace:
        tags = await unless_disconnected(
            request, predictor.tag(upload.data, top_k, deadline, trace)
        )
    return JSONResponse([{"name": t.name, "prob": t.prob} for t in tags])
