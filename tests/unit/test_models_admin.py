"""What the admin routes' load asks (``app.v2.server.load_asked``, ``Models.load``), refused
as a client error before anything changes."""

from __future__ import annotations

from typing import Any

import pytest

from app.errors import InvalidRequest
from app.services.models import Models
from app.services.registry import ModelRegistry
from app.v2.server import load_asked

NOTHING: Any = None  # never reached: the call is refused first


@pytest.mark.parametrize("parameters", [1, True, "version", [["version", "2"]], 2.5])
def test_a_load_whose_parameters_are_not_an_object_is_422_not_500(parameters: object) -> None:
    """A regression: ``{"parameters": 1}`` was iterated, a ``TypeError``: 500."""
    with pytest.raises(InvalidRequest):
        load_asked({"parameters": parameters})


async def test_a_load_that_replaces_what_serves_is_refused_in_broker_mode() -> None:
    """A regression: ``replace`` in broker mode pinned the name unloaded in Redis for the
    whole fleet (every other front end answered 404 for it until the load ended, and a
    failed load left it served nowhere), where the docs say broker workers load beside."""
    registry = ModelRegistry()
    models = Models(
        registry, NOTHING, NOTHING, NOTHING, dtype="auto", drain_timeout_s=1,
        load_timeout_s=1, in_place=False,
    )  # fmt: skip
    with pytest.raises(InvalidRequest, match="replace is for one process"):
        await models.load("tagger", 2, replace=True)
    assert registry.versions() == [] and registry.names() == []
