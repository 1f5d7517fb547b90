"""TorchServe's inference API, as its clients call it: ``POST`` (or ``PUT``)
``/predictions/{name}[/{version}]`` with the image as the whole body (``curl -T``, any
Content-Type) or as the multipart field ``data`` (or ``body``, or ``image``), answered as
its stock ``image_classifier`` handler answers: ``{"label": probability, ...}``, the top 5
(or every class of a model with fewer), most probable first. ``GET /ping`` in its health
form and ``GET /models`` in its management API's list form. Its management calls that
register or scale models are not here: they load from URLs, which this server refuses by
design (models load from its repository only)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from app import tracing
from app.dependencies import (
    REQUIRES_API_KEY,
    admitted,
    app_settings,
    cache_use_of,
    is_ready,
    serving_engine,
    ticket_of,
)
from app.routers.common import ERRORS, batch_trace, request_deadline, unless_disconnected
from app.routers.direct import DirectRoute
from app.routers.uploads import FILE_FIELD, read_upload

STOCK_TOP_K = 5  # what TorchServe's stock image_classifier answers
IMAGE_FIELDS = frozenset({"data", "body", FILE_FIELD})  # TorchServe's handlers read data or body

predictions = APIRouter(
    prefix="/predictions",
    tags=["TorchServe inference API"],
    route_class=DirectRoute,
    dependencies=REQUIRES_API_KEY,
)
router = APIRouter(tags=["TorchServe inference API"])

_BODY = {
    "requestBody": {
        "content": {
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {"data": {"type": "string", "format": "binary"}},
                    "required": ["data"],
                }
            },
        }
    }
}
_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {
            "application/json": {
                "schema": {"type": "object", "additionalProperties": {"type": "number"}},
                "example": {"tabby": 0.41, "tiger_cat": 0.35, "Egyptian_cat": 0.19},
            }
        }
    }
}


async def _predict(request: Request) -> JSONResponse:
    name = request.path_params["name"]
    version = request.path_params.get("version")
    settings = app_settings(request)
    deadline = request_deadline(request, settings.mb_request_timeout)
    async with admitted(request, name, version) as served:
        predictor = served.predictor
        assert predictor is not None, "a serving version has its predictor"
        predictor.check_admission(ticket_of(request))  # before the upload is read
        with tracing.span("read upload"):
            upload = await read_upload(
                request, settings.max_upload_bytes, image_fields=IMAGE_FIELDS, any_body=True
            )
        predictor.require_classifier()
        k = min(STOCK_TOP_K, len(predictor.classes))
        with batch_trace(request) as trace:
            (tags,) = await unless_disconnected(
                request,
                predictor.tags(
                    upload.data[:1],
                    k,
                    deadline,
                    trace,
                    ticket=ticket_of(request),
                    cache=cache_use_of(request),
                ),
            )
    return JSONResponse({tag.name: tag.prob for tag in tags})


for method in ("POST", "PUT"):
    for path in ("/{name}", "/{name}/{version}"):
        predictions.add_api_route(
            path,
            _predict,
            methods=[method],
            responses={**ERRORS, **_ANSWER},
            openapi_extra=_BODY,
            include_in_schema=method == "POST",
            operation_id=f"predictions_{method.lower()}{'_version' if 'version' in path else ''}",
            summary="Tag an image as TorchServe's stock image_classifier answers",
        )


@router.get("/ping", responses={500: {"description": "not ready"}})
async def ping(request: Request) -> JSONResponse:
    """TorchServe's health check: ``{"status": "Healthy"}`` while this server is ready."""
    if is_ready(request):
        return JSONResponse({"status": "Healthy"})
    return JSONResponse({"status": "Unhealthy"}, status_code=500)


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    """The models served, in the form of TorchServe's management API list: ``modelUrl`` is
    the archive a model was imported from (empty for others)."""
    registry = serving_engine(request).registry
    listed = []
    for name in registry.names():
        version = registry.serving(name)
        manifest = version.manifest if version is not None else None
        archive = manifest.imported.archive if manifest and manifest.imported else ""
        listed.append({"modelName": name, "modelUrl": archive})
    return {"models": listed}
