"""Prediction endpoints."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse

from app.dependencies import ApiKeyDep, PredictorDep, SettingsDep
from app.routers.common import (
    batch_trace,
    read_upload,
    request_deadline,
    unless_disconnected,
)
from app.schemas import ErrorResponse, TagOut

router = APIRouter(prefix="/predict", tags=["predict"], dependencies=[ApiKeyDep])

ERRORS: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 413, 415, 422, 503, 504)
}
ImageField = Annotated[UploadFile, File(description="the image (JPEG, PNG, WebP, BMP or GIF)")]


@router.post("/embedding", response_model=list[float], responses=ERRORS)
async def embedding(
    request: Request, image: ImageField, predictor: PredictorDep, settings: SettingsDep
) -> JSONResponse:
    """Embed one image: the model's pooled feature vector as a list of floats."""
    deadline = request_deadline(request, settings.mb_request_timeout)
    data = await read_upload(image, settings.max_upload_bytes)
    with batch_trace(request) as trace:
        vector = await unless_disconnected(request, predictor.embedding(data, deadline, trace))
    return JSONResponse(vector)


@router.post("/tag", response_model=list[TagOut], responses=ERRORS)
async def tag(
    request: Request,
    image: ImageField,
    predictor: PredictorDep,
    settings: SettingsDep,
    k: Annotated[int, Form(ge=1, le=1000, description="how many labels to return")] = 5,
) -> JSONResponse:
    """Tag one image: the top-k class names with their probabilities, most probable first."""
    deadline = request_deadline(request, settings.mb_request_timeout)
    data = await read_upload(image, settings.max_upload_bytes)
    with batch_trace(request) as trace:
        tags = await unless_disconnected(request, predictor.tag(data, k, deadline, trace))
    return JSONResponse([{"name": t.name, "prob": t.prob} for t in tags])
