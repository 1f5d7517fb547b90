"""The model repository, over the Open Inference Protocol's repository extension (as Triton
serves it): the index of every model and version, and, for the operator, loading and
unloading versions while the server serves.

``GET`` or ``POST /v2/repository/index`` is always there. ``POST
/v2/repository/models/{name}/load`` and ``.../unload`` exist only when ``ADMIN_API_KEY`` is
set, and need it as a bearer token (``admin``, below). A load reads only from inside the
repository, by name, verifying every sha256; nothing is ever fetched from a URL.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from app.dependencies import REQUIRES_ADMIN_KEY, serving_engine
from app.routers.common import V2_ERRORS
from app.v2.http_body import JSON_TYPE, inlined_schema, read_json, validated
from app.v2.server import LoadParameters, LoadRequest, UnloadRequest, load_asked, unload_asked

router = APIRouter(prefix="/v2/repository", tags=["model repository"])
admin = APIRouter(
    prefix="/v2/repository", tags=["model repository"], dependencies=REQUIRES_ADMIN_KEY
)
ADMIN_ERRORS = {
    **V2_ERRORS,
    422: {"description": "the load failed (model_load_failed); the version before serves on"},
    507: {"description": "over MB_MODEL_MEMORY (model_memory_budget)"},
}


class IndexEntry(BaseModel):
    name: str
    version: str
    model_id: str | None = Field(description="the served id its answers carry (X-Model-Id)")
    state: str = Field(description="unavailable, loading, ready, draining or failed")
    serving: bool = Field(description="the version its name serves now")
    reason: str = Field("", description="why it failed (the step, then what), or drains")
    in_flight: int = 0
    workers: int = Field(0, description="workers holding it ready")
    memory_bytes: int | None = Field(None, description="what it costs a worker holding it")
    runtime: str | None = Field(None, description="what runs it on its workers (MB_RUNTIME)")
    runtimes_failed: dict[str, str] = Field(
        default_factory=dict,
        description="runtimes its store holds that failed their self-test or load, and why",
    )
    slowdown: float | None = Field(
        None,
        description="how many times slower it runs than on the fastest of those, as its "
        "export measured them (absent: not slower, or not known)",
    )


async def _load_request(request: Request) -> LoadParameters:
    """The body as sent (JSON whatever its Content-Type, as tritonclient sends none; empty:
    the defaults)."""
    raw = await request.body()
    return load_asked(read_json(raw) if raw.strip() else {})


LOAD_BODY = {
    "requestBody": {
        "required": False,
        "content": {JSON_TYPE: {"schema": inlined_schema(LoadRequest)}},
    }
}


class Loaded(BaseModel):
    name: str
    version: str
    model_id: str
    state: str


@router.get("/index", response_model=list[IndexEntry], operation_id="repository_index")
async def index(request: Request) -> list[dict[str, Any]]:
    """Every model and version: on disk (``unavailable``), loading, ready, draining or
    failed (with the reason), its served id and what it costs a worker."""
    engine = serving_engine(request)
    return engine.models.index(engine.transport.worker_status())


class IndexRequest(BaseModel):
    """What a POST to the index may ask (Triton's): only what requests can use now."""

    model_config = ConfigDict(extra="forbid")

    ready: StrictBool = Field(False, description="only the versions serving (what infer answers)")


# The same by POST, as Triton's clients ask for it (a route of its own, so that each method
# has its own OpenAPI operation id), with ``{"ready": true}`` as Triton takes it.
@router.post(
    "/index",
    response_model=list[IndexEntry],
    operation_id="repository_index_post",
    responses={422: V2_ERRORS[422]},
    openapi_extra={
        "requestBody": {
            "required": False,
            "content": {JSON_TYPE: {"schema": inlined_schema(IndexRequest)}},
        }
    },
)
async def index_post(request: Request) -> list[dict[str, Any]]:
    """The index (as ``GET``); ``{"ready": true}``: only the versions serving."""
    raw = await request.body()
    asked: IndexRequest = validated(IndexRequest, read_json(raw) if raw.strip() else {})
    rows = await index(request)
    return [row for row in rows if row["serving"]] if asked.ready else rows


@admin.post(
    "/models/{name}/load", response_model=Loaded, responses=ADMIN_ERRORS, openapi_extra=LOAD_BODY
)
async def load(name: str, request: Request) -> Loaded:
    """Load a version of ``name`` (the newest on disk, or ``parameters.version``) beside
    the one serving, and switch to it once verified, self-tested and warmed up; answers once
    it serves. If it fails, the version before serves on and the answer says why."""
    engine = serving_engine(request)
    parameters = await _load_request(request)
    number = int(parameters.version) if parameters.version is not None else None
    version = await engine.models.load(name, number, replace=parameters.replace)
    return Loaded(
        name=version.name,
        version=str(version.version),
        model_id=version.served_id,
        state=version.state.shown,
    )


UNLOAD_BODY = {
    "requestBody": {
        "required": False,
        "content": {JSON_TYPE: {"schema": inlined_schema(UnloadRequest)}},
    }
}


@admin.post(
    "/models/{name}/unload", response_model=Loaded, responses=V2_ERRORS,
    openapi_extra=UNLOAD_BODY,
)  # fmt: skip
async def unload(name: str, request: Request) -> Loaded:
    """Stop serving ``name`` (one version serves at a time: ``parameters.version``, if
    sent, must be it): requests already admitted finish, then its models are unloaded;
    answers once their memory is given back."""
    engine = serving_engine(request)
    raw = await request.body()
    number = unload_asked(read_json(raw) if raw.strip() else {})
    version = await engine.models.unload(name, number)
    return Loaded(
        name=version.name,
        version=str(version.version),
        model_id=version.served_id,
        state=version.state.shown,
    )
