"""What the routes need from the application state: settings, the model version a request is
admitted for, readiness and the API keys.

Plain functions, called directly by the prediction routes: FastAPI's dependency resolution
costs more per request than these lookups. The ``Annotated`` aliases serve the cheaper,
rarer routes (``/info``); they are ``async def`` because FastAPI runs plain ``def``
dependencies in its thread pool. ``REQUIRES_API_KEY``, ``REQUIRES_ADMIN_KEY`` and
``REQUIRES_METRICS_KEY`` are the one declaration of which routes want which scope (``infer``,
``admin``, ``metrics``: ``API_KEY``, ``ADMIN_API_KEY``, or a keys file's): the routes run
them, and the OpenAPI docs show them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request, Security
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import HTTPConnection

from app.batching import Ticket
from app.cache import CacheUse
from app.errors import NotReady
from app.services.registry import ModelVersion
from app.settings import Settings
from app.tenancy import PRIORITY, Caller, Scope, Tenancy, bearer_token

if TYPE_CHECKING:  # the engine is wired by app.main; the routes only read it
    from app.engine import Engine

READY_RETRY_AFTER_S = 1  # what a readiness 503 tells a client to wait
MODEL_PARAMETER = "model"  # ?model=NAME chooses the model
MODEL_ID_HEADER = "x-model-id"  # pins the exact export (and precision) that must answer


def header(request: HTTPConnection, name: str) -> str | None:
    """The request's ``name`` header, or None. For the headers a request seldom sends:
    Starlette's ``headers.get`` raises and catches a KeyError for each missing one, a
    noticeable share of the event loop's time per request under load."""
    key = name.lower().encode("latin-1")
    for field, value in request.scope["headers"]:
        if field == key:
            return str(value.decode("latin-1"))
    return None


def query_param(request: HTTPConnection, name: str) -> str | None:
    """The query parameter ``name``, or None; free when there is no query string."""
    if not request.scope.get("query_string"):
        return None
    value = request.query_params.getlist(name)
    return value[0] if value else None


def app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def running_engine(request: HTTPConnection) -> Engine | None:
    """The engine once it has started (``None`` before)."""
    engine: Engine | None = getattr(request.app.state, "engine", None)
    return engine


def serving_engine(request: Request) -> Engine:
    """The engine, or 503 while the server starts or stops."""
    engine = running_engine(request)
    if engine is None or request.app.state.closing:
        raise NotReady("the server is starting or stopping")
    return engine


@asynccontextmanager
async def admitted(
    request: Request, name: str | None = None, number: str | None = None
) -> AsyncIterator[ModelVersion]:
    """The model version this request gets, resolved once, now: ``name`` (default: the
    ``model`` query parameter, else the default model), pinned by an ``X-Model-Id`` header
    or a version ``number``; held until the block ends, so it is not unloaded under the
    request. Its id goes on the answer and in the request's log line and metrics. A broker
    front end that knows the model but has seen no worker serve it looks at the workers
    again first (they may have come since its last look)."""
    engine = serving_engine(request)
    if name is None:
        name = query_param(request, MODEL_PARAMETER)
    pinned = (header(request, MODEL_ID_HEADER) or "").strip() or None  # empty: no pin
    async with engine.admitted(name, pinned, number) as version:
        state = request.state
        state.model_id, state.model, state.model_version = (
            version.served_id,
            version.name,
            version.version,
        )
        yield version


def is_model_ready(request: Request, version: ModelVersion) -> bool:
    """Whether ``version`` takes requests: it serves, a ready worker holds it, and the
    server is not stopping (whatever the other names' state)."""
    engine = running_engine(request)
    closing = request.app.state.closing
    return engine is not None and engine.answers_for(version) and not closing


def is_ready(request: Request) -> bool:
    """Whether this server takes requests: a model worker is ready, a model version serves,
    and it is not stopping."""
    engine = running_engine(request)
    return engine is not None and engine.serves() and not request.app.state.closing


def readiness_response(body: dict[str, Any], ready: bool) -> JSONResponse:
    """A readiness answer: 200, or 503 with ``Retry-After`` like every other 503."""
    if ready:
        return JSONResponse(body)
    return JSONResponse(body, 503, headers={"Retry-After": str(READY_RETRY_AFTER_S)})


class Requires(HTTPBearer):
    """``Authorization: Bearer <key>`` with a key that has ``scope`` (``app.tenancy``): the
    caller goes into ``request.state.caller``; 401 or 403 (through the error table)
    otherwise. A security dependency, so the routes that declare it show a bearer scheme in
    the OpenAPI docs; it needs nothing but the request, so a ``DirectRoute`` can run it
    itself."""

    def __init__(self, scope: Scope, scheme_name: str, description: str) -> None:
        super().__init__(scheme_name=scheme_name, auto_error=False, description=description)
        self.scope = scope

    async def __call__(self, request: HTTPConnection) -> HTTPAuthorizationCredentials | None:
        tenancy: Tenancy = request.app.state.tenancy
        sent = header(request, "authorization")
        request.state.caller = tenancy.caller(sent, self.scope)
        if sent is None:
            return None
        return HTTPAuthorizationCredentials(scheme="Bearer", credentials=bearer_token(sent) or "")


REQUIRES_API_KEY = [
    Security(Requires(Scope.INFER, "bearer", "API_KEY, or a key with the infer scope"))
]
REQUIRES_ADMIN_KEY = [
    Security(Requires(Scope.ADMIN, "admin", "ADMIN_API_KEY, or a key with the admin scope"))
]
REQUIRES_METRICS_KEY = [
    Security(Requires(Scope.METRICS, "metrics", "a key with the metrics scope (MB_KEYS_FILE)"))
]


def caller_of(request: HTTPConnection) -> Caller | None:
    """The caller a route's guard admitted (None on a route without one)."""
    caller: Caller | None = getattr(request.state, "caller", None)
    return caller


def ticket_of(request: HTTPConnection, asked: object = None, where: str = PRIORITY) -> Ticket:
    """Where the request queues (``Tenancy.ticket``): its caller's tenant, at the priority
    ``asked`` (``where`` names it for a 422; default: the ``X-Priority`` header)."""
    if asked is None:
        asked, where = header(request, PRIORITY), PRIORITY
    tenancy: Tenancy = request.app.state.tenancy
    return tenancy.ticket(caller_of(request), asked, where)


def cache_use_of(request: HTTPConnection) -> CacheUse | None:
    """How this request uses the response cache (None when the server has none): afresh if
    it says ``Cache-Control: no-cache`` (or ``max-age=0``); the outcome goes out as
    ``X-Cache`` (``app.observability``)."""
    engine = running_engine(request)
    if engine is None or engine.cache is None:
        return None
    use = CacheUse.asked(header(request, "cache-control"))
    request.state.cache = use
    return use


async def _settings(request: Request) -> Settings:
    return app_settings(request)


SettingsDep = Annotated[Settings, Depends(_settings)]
