"""Health, readiness and class names."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from app.dependencies import PredictorDep
from app.schemas import Health, Readiness

router = APIRouter(tags=["meta"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """Liveness: the process is up and its event loop answers."""
    return Health(status="ok")


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
async def readyz(request: Request) -> JSONResponse:
    """Readiness: 200 while a model worker is ready and the server is not stopping, else 503."""
    state = request.app.state
    pool, streamer = getattr(state, "pool", None), getattr(state, "streamer", None)
    ready = pool is not None and pool.ready and not state.closing
    body = Readiness(
        status="ready" if ready else "not_ready",
        queue_depth=streamer.queue_depth if streamer is not None else 0,
        in_flight=streamer.in_flight if streamer is not None else 0,
        workers=pool.describe() if pool is not None else [],
    )
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)


@router.get("/tags", response_model=list[str])
async def tags(predictor: PredictorDep) -> list[str]:
    """The class names the tagger can return, in the model's index order."""
    return predictor.classes
