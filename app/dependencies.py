"""``Annotated`` dependency aliases used by the routers.

The dependencies are ``async def`` on purpose: FastAPI runs plain ``def`` dependencies in its
thread pool, which would cost three thread hops per request for a few attribute lookups."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request

from app.errors import NotReady, Unauthorized
from app.services.predictor import Predictor
from app.settings import Settings


async def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def _predictor(request: Request) -> Predictor:
    predictor: Predictor | None = getattr(request.app.state, "predictor", None)
    if predictor is None or request.app.state.closing:
        raise NotReady("the server is starting or stopping")
    return predictor


async def _require_api_key(request: Request) -> None:
    expected = (await _settings(request)).api_key
    if expected is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(
        token.strip().encode(), expected.get_secret_value().encode()
    ):
        raise Unauthorized("send 'Authorization: Bearer <API_KEY>'")


SettingsDep = Annotated[Settings, Depends(_settings)]
PredictorDep = Annotated[Predictor, Depends(_predictor)]
ApiKeyDep = Depends(_require_api_key)
