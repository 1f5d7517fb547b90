"""``Annotated`` dependency aliases used by the routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.errors import NotReady
from app.services.predictor import Predictor
from app.settings import Settings


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def _predictor(request: Request) -> Predictor:
    predictor: Predictor | None = getattr(request.app.state, "predictor", None)
    if predictor is None:
        raise NotReady("the model workers are not ready yet")
    return predictor


SettingsDep = Annotated[Settings, Depends(_settings)]
PredictorDep = Annotated[Predictor, Depends(_predictor)]
