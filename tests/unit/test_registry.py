"""``app.services.registry``: one test per move of a model version, failures included, and
how a request resolves its version."""

from __future__ import annotations

from typing import Any

import pytest

from app.errors import InvalidRequest, ModelNotFound, ModelVersionUnavailable, NotReady
from app.repository import ModelState
from app.services.registry import ModelRegistry, ModelVersion

MANIFEST: Any = object()  # the registry stores it, never reads it
PREDICTOR: Any = object()


def _serving(registry: ModelRegistry, name: str, number: int, served_id: str) -> ModelVersion:
    version = registry.loading(name, number, served_id)
    registry.ready(version, MANIFEST, PREDICTOR)
    registry.switch(version)
    return version


def _state(version: ModelVersion) -> ModelState:
    return version.state  # read afresh (mypy narrows an attribute across calls)


def test_a_version_loads_serves_drains_and_goes() -> None:
    registry = ModelRegistry()
    v1 = registry.loading("tagger", 1, "t@1")
    assert registry.versions() == [v1] and v1.state is ModelState.LOADING
    with pytest.raises(NotReady):  # known, but nothing serves it yet
        registry.resolve("tagger")
    registry.ready(v1, MANIFEST, PREDICTOR)
    assert _state(v1) is ModelState.READY and registry.serving("tagger") is None
    assert registry.switch(v1) is None
    assert registry.resolve("tagger") is v1 and registry.resolve(None) is v1
    v2 = registry.loading("tagger", 2, "t@2")
    registry.ready(v2, MANIFEST, PREDICTOR)
    assert registry.resolve("tagger") is v1  # ready, but not switched yet
    assert registry.switch(v2) is v1
    assert _state(v1) is ModelState.DRAINING and v1.drained.is_set()  # nothing was in flight
    assert registry.resolve("tagger") is v2
    registry.gone(v1)
    assert _state(v1) is ModelState.GONE and v1 not in registry.versions()


def test_a_failed_load_leaves_the_version_before_serving() -> None:
    registry = ModelRegistry()
    v1 = _serving(registry, "tagger", 1, "t@1")
    v2 = registry.loading("tagger", 2, "t@2")
    registry.failed(v2, "self-test: cosine 0.5")
    assert v2.state is ModelState.FAILED and v2.reason == "self-test: cosine 0.5"
    assert registry.resolve("tagger") is v1 and v2 in registry.versions()
    with pytest.raises(RuntimeError):
        registry.switch(v2)  # only a ready version can serve
    again = registry.loading("tagger", 2, "t@2")  # a retry starts afresh
    assert again is not v2 and again.state is ModelState.LOADING
    registry.ready(again, MANIFEST, PREDICTOR)
    registry.switch(again)
    assert all(v.state is not ModelState.FAILED for v in registry.versions())


def test_a_request_admitted_before_a_switch_keeps_its_version_until_answered() -> None:
    registry = ModelRegistry()
    v1 = _serving(registry, "tagger", 1, "t@1")
    with registry.admit("tagger") as admitted:
        assert admitted is v1 and v1.in_flight == 1
        _serving(registry, "tagger", 2, "t@2")
        assert v1.state is ModelState.DRAINING and not v1.drained.is_set()
        with registry.admit("tagger") as later:
            assert later.served_id == "t@2"
    assert v1.in_flight == 0 and v1.drained.is_set()


def test_a_draining_version_can_be_revived_before_it_is_unloaded() -> None:
    registry = ModelRegistry()
    v1 = _serving(registry, "tagger", 1, "t@1")
    _serving(registry, "tagger", 2, "t@2")
    registry.revive(v1)
    assert v1.state is ModelState.READY and not v1.drained.is_set()
    registry.switch(v1)
    assert registry.resolve("tagger") is v1


def test_a_pin_gets_exactly_that_export_or_409_naming_what_is_served() -> None:
    registry = ModelRegistry()
    _serving(registry, "tagger", 1, "t@1")
    embedder = _serving(registry, "embedder", 4, "e@4")
    assert registry.resolve(None, "e@4") is embedder  # a pin alone finds its name
    assert registry.resolve("embedder", "e@4") is embedder
    with pytest.raises(ModelVersionUnavailable, match="served: t@1"):
        registry.resolve("tagger", "e@4")  # served, but not as this name
    with pytest.raises(ModelVersionUnavailable, match="served: e@4, t@1"):
        registry.resolve(None, "t@0")
    _serving(registry, "tagger", 2, "t@2")  # t@1 drains: no longer served to new requests
    with pytest.raises(ModelVersionUnavailable):
        registry.resolve(None, "t@1")


def test_a_version_number_must_be_the_serving_one() -> None:
    registry = ModelRegistry()
    v2 = _serving(registry, "tagger", 2, "tagger@abcdef123456")
    assert registry.resolve("tagger", number="2") is v2
    assert registry.resolve("tagger", number="abcdef123456") is v2
    with pytest.raises(ModelVersionUnavailable, match="version '1' of 'tagger' is not served"):
        registry.resolve("tagger", number="1")


def test_names_unknown_malformed_or_ambiguous() -> None:
    registry = ModelRegistry()
    _serving(registry, "tagger", 1, "t@1")
    _serving(registry, "embedder", 1, "e@1")
    with pytest.raises(ModelNotFound, match="no model named 'nope'"):
        registry.resolve("nope")
    with pytest.raises(InvalidRequest, match="a model name"):
        registry.resolve("../tagger")
    with pytest.raises(InvalidRequest, match="serves several models"):
        registry.resolve(None)
    registry.default_name = "embedder"
    assert registry.resolve(None).name == "embedder"


def test_an_unloaded_name_drains_and_is_no_longer_served() -> None:
    registry = ModelRegistry()
    v1 = _serving(registry, "tagger", 1, "t@1")
    assert registry.retire("tagger") is v1
    assert v1.state is ModelState.DRAINING and registry.names() == []
    with pytest.raises(ModelNotFound):
        registry.resolve("tagger")
    assert registry.retire("tagger") is None
    # Replaced in place: 503 until the next version serves.
    _serving(registry, "tagger", 2, "t@2")
    registry.retire("tagger", coming_back=True)
    with pytest.raises(NotReady):
        registry.resolve("tagger")
