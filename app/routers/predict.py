"""Prediction endpoints."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, UploadFile
from fastapi.responses import JSONResponse

from app.dependencies import PredictorDep, SettingsDep
from app.errors import PayloadTooLarge
from app.schemas import ErrorResponse, TagOut

router = APIRouter(prefix="/predict", tags=["predict"])

ERRORS: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorResponse} for status in (400, 413, 415, 422, 503, 504)
}
ImageField = Annotated[UploadFile, File(description="the image (JPEG, PNG, WebP, BMP or GIF)")]


async def _read(image: UploadFile, max_bytes: int) -> bytes:
    if image.size is not None and image.size > max_bytes:
        raise PayloadTooLarge(f"upload is {image.size} bytes; at most {max_bytes} allowed")
    data = await image.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise PayloadTooLarge(f"upload is over {max_bytes} bytes")
    return data


@router.post("/embedding", response_model=list[float], responses=ERRORS)
async def embedding(
    image: ImageField, predictor: PredictorDep, settings: SettingsDep
) -> JSONResponse:
    """Embed one image: the model's pooled feature vector as a list of floats."""
    vector = await predictor.embedding(await _read(image, settings.max_upload_bytes))
    return JSONResponse(vector)


@router.post("/tag", response_model=list[TagOut], responses=ERRORS)
async def tag(
    image: ImageField,
    predictor: PredictorDep,
    settings: SettingsDep,
    k: Annotated[int, Form(ge=1, le=1000, description="how many labels to return")] = 5,
) -> JSONResponse:
    """Tag one image: the top-k class names with their probabilities, most probable first."""
    tags = await predictor.tag(await _read(image, settings.max_upload_bytes), k)
    return JSONResponse([{"name": t.name, "prob": t.prob} for t in tags])
