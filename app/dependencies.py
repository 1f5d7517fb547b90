"""What the routes need from the application state: settings, the predictor, readiness and
the API key.

Plain functions, called directly by the prediction routes: FastAPI's dependency resolution
costs more per request than these lookups. The ``Annotated`` aliases serve the cheaper,
rarer routes (``/info``, ``/tags``); they are ``async def`` because FastAPI runs plain
``def`` dependencies in its thread pool. ``REQUIRES_API_KEY`` is the one declaration of
which routes want ``API_KEY``: the routes run it, and the OpenAPI docs show it."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request, Security
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr
from starlette.requests import HTTPConnection

from app.errors import NotReady, Unauthorized
from app.services.predictor import Predictor
from app.settings import Settings

if TYPE_CHECKING:  # the engine is wired by app.main; the routes only read it
    from app.engine import Engine

READY_RETRY_AFTER_S = 1  # what a readiness 503 tells a client to wait


def app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def serving_predictor(request: Request) -> Predictor:
    """The predictor, or 503 while the server starts or stops."""
    predictor: Predictor | None = getattr(request.app.state, "predictor", None)
    if predictor is None or request.app.state.closing:
        raise NotReady("the server is starting or stopping")
    return predictor


def running_engine(request: Request) -> Engine | None:
    """The engine once it has started (``None`` before)."""
    engine: Engine | None = getattr(request.app.state, "engine", None)
    return engine


def is_ready(request: Request) -> bool:
    """Whether this server takes requests: a model worker is ready and it is not stopping."""
    engine = running_engine(request)
    return engine is not None and engine.transport.ready and not request.app.state.closing


def readiness_response(body: dict[str, Any], ready: bool) -> JSONResponse:
    """A readiness answer: 200, or 503 with ``Retry-After`` like every other 503."""
    if ready:
        return JSONResponse(body)
    return JSONResponse(body, 503, headers={"Retry-After": str(READY_RETRY_AFTER_S)})


class ApiKey(HTTPBearer):
    """``Authorization: Bearer <API_KEY>``, checked when ``API_KEY`` is set: 401 (through
    the error table) otherwise. A security dependency, so the routes that declare it show a
    bearer scheme in the OpenAPI docs; it needs nothing but the request, so a
    ``DirectRoute`` can run it itself."""

    def __init__(self) -> None:
        super().__init__(
            scheme_name="bearer", auto_error=False, description="API_KEY, when the server sets one"
        )

    async def __call__(self, request: HTTPConnection) -> HTTPAuthorizationCredentials | None:
        expected: SecretStr | None = request.app.state.settings.api_key
        if expected is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), expected.get_secret_value().encode()
        ):
            raise Unauthorized("send 'Authorization: Bearer <API_KEY>'")
        return HTTPAuthorizationCredentials(scheme="Bearer", credentials=token.strip())


REQUIRES_API_KEY = [Security(ApiKey())]


async def _settings(request: Request) -> Settings:
    return app_settings(request)


async def _predictor(request: Request) -> Predictor:
    return serving_predictor(request)


SettingsDep = Annotated[Settings, Depends(_settings)]
PredictorDep = Annotated[Predictor, Depends(_predictor)]
