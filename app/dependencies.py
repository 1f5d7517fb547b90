"""What the routes need from the application state: settings, the predictor, the API key check.

Plain functions, called directly by the prediction routes: FastAPI's dependency resolution
costs more per request than these lookups. The ``Annotated`` aliases serve the cheaper,
rarer routes (``/info``, ``/tags``); they are ``async def`` because FastAPI runs plain
``def`` dependencies in its thread pool."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request

from app.errors import NotReady, Unauthorized
from app.services.predictor import Predictor
from app.settings import Settings


def app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def serving_predictor(request: Request) -> Predictor:
    """The predictor, or 503 while the server starts or stops."""
    predictor: Predictor | None = getattr(request.app.state, "predictor", None)
    if predictor is None or request.app.state.closing:
        raise NotReady("the server is starting or stopping")
    return predictor


def is_ready(request: Request) -> bool:
    """Whether this server takes requests: a model worker is ready and it is not stopping."""
    transport = getattr(request.app.state, "transport", None)
    return transport is not None and transport.ready and not request.app.state.closing


def require_api_key(request: Request, settings: Settings) -> None:
    """401 unless ``API_KEY`` is unset or the request carries it as a bearer token."""
    expected = settings.api_key
    if expected is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(
        token.strip().encode(), expected.get_secret_value().encode()
    ):
        raise Unauthorized("send 'Authorization: Bearer <API_KEY>'")


async def _settings(request: Request) -> Settings:
    return app_settings(request)


async def _predictor(request: Request) -> Predictor:
    return serving_predictor(request)


SettingsDep = Annotated[Settings, Depends(_settings)]
PredictorDep = Annotated[Predictor, Depends(_predictor)]
