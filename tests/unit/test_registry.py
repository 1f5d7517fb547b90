"""``app.services.registry``: one test per move of a model version, failures included, and
how a request resolves its version."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from app.errors import InvalidRequest, ModelNotFound, ModelVersionUnavailable, NotReady
from app.lifecycle import IllegalMove, VersionState
from app.services.registry import ModelRegistry, ModelVersion

MANIFEST: Any = object()  # the registry stores it, never reads it
PREDICTOR: Any = object()
OTHER: Any = object()


def _serving(registry: ModelRegistry, name: str, number: int, served_id: str) -> ModelVersion:
    version = registry.loading(name, number, served_id)
    registry.ready(version, MANIFEST, PREDICTOR)
    registry.switch(version)
    return version


def _state(version: ModelVersion) -> VersionState:
    return version.state  # read afresh (mypy narrows an attribute across calls)


def test_a_version_loads_serves_drains_and_goes() -> None:
    registry = ModelRegistry()
    v1 = registry.loading("tagger", 1, "t@1")
    assert registry.versions() == [v1] and v1.state is VersionState.LOADING
    with pytest.raises(NotReady):  # known, but nothing serves it yet
        registry.resolve("tagger")
    registry.ready(v1, MANIFEST, PREDICTOR)
    assert _state(v1) is VersionState.READY and registry.serving("tagger") is None
    assert registry.switch(v1) is None
    assert _state(v1) is VersionState.SERVING
    assert registry.resolve("tagger") is v1 and registry.resolve(None) is v1
    v2 = registry.loading("tagger", 2, "t@2")
    registry.ready(v2, MANIFEST, PREDICTOR)
    assert registry.resolve("tagger") is v1  # ready, but not switched yet
    assert registry.switch(v2) is v1
    assert _state(v1) is VersionState.DRAINING and v1.drained.is_set()  # nothing was in flight
    assert registry.resolve("tagger") is v2
    registry.gone(v1)
    assert _state(v1) is VersionState.UNLOADED and v1 not in registry.versions()


def test_a_failed_load_leaves_the_version_before_serving() -> None:
    registry = ModelRegistry()
    v1 = _serving(registry, "tagger", 1, "t@1")
    v2 = registry.loading("tagger", 2, "t@2")
    registry.failed(v2, "self-test", "cosine 0.5")
    assert v2.state is VersionState.FAILED and (v2.step, v2.reason) == ("self-test", "cosine 0.5")
    assert registry.resolve("tagger") is v1 and v2 in registry.versions()
    with pytest.raises(IllegalMove):
        registry.switch(v2)  # only a ready version can serve
    again = registry.loading("tagger", 2, "t@2")  # a retry loads it afresh
    assert again is v2 and again.state is VersionState.LOADING and again.reason == ""
    registry.ready(again, MANIFEST, PREDICTOR)
    registry.switch(again)
    assert all(v.state is not VersionState.FAILED for v in registry.versions())


def test_a_failure_is_on_its_own_row_even_when_it_claims_the_serving_export() -> None:
    """A corrupted copy of version 4 published as version 5 claims version 4's served id:
    its failure is version 5's, and version 4 serves on, untouched."""
    registry = ModelRegistry()
    v4 = _serving(registry, "tagger", 4, "t@4")
    v5 = registry.loading("tagger", 5, "t@4")
    assert v5 is not v4
    registry.failed(v5, "verify", "embedding.pt does not match its sha256")
    assert v4.state is VersionState.SERVING and v4.reason == ""
    assert [(v.version, v.state) for v in registry.versions()] == [
        (4, VersionState.SERVING),
        (5, VersionState.FAILED),
    ]
    assert registry.holders("t@4") == [v4]


def test_failures_of_older_versions_are_forgotten_once_a_newer_one_serves() -> None:
    registry = ModelRegistry()
    _serving(registry, "tagger", 1, "t@1")
    for number in (2, 4):
        registry.failed(registry.loading("tagger", number, f"t@{number}"), "load", "boom")
    _serving(registry, "tagger", 3, "t@3")
    assert [(v.version, v.state.value) for v in registry.versions()] == [
        (1, "draining"),
        (3, "serving"),
        (4, "failed"),
    ]


def test_a_request_admitted_before_a_switch_keeps_its_version_until_answered() -> None:
    registry = ModelRegistry()
    v1 = _serving(registry, "tagger", 1, "t@1")
    with registry.admit("tagger") as admitted:
        assert admitted is v1 and v1.in_flight == 1
        _serving(registry, "tagger", 2, "t@2")
        assert v1.state is VersionState.DRAINING and not v1.drained.is_set()
        with registry.admit("tagger") as later:
            assert later.served_id == "t@2"
    assert v1.in_flight == 0 and v1.drained.is_set()


def test_a_draining_version_serves_again_before_it_is_unloaded() -> None:
    registry = ModelRegistry()
    v1 = _serving(registry, "tagger", 1, "t@1")
    v2 = _serving(registry, "tagger", 2, "t@2")
    assert v1.drained.is_set()
    assert registry.switch(v1) is v2  # a rollback: no load
    assert v1.state is VersionState.SERVING and not v1.drained.is_set()
    assert registry.resolve("tagger") is v1 and v2.state is VersionState.DRAINING


def test_an_unloaded_version_is_forgotten_and_a_renumbered_one_moves_row() -> None:
    registry = ModelRegistry()
    v1 = _serving(registry, "tagger", 1, "t@1")
    _serving(registry, "tagger", 2, "t@2")
    registry.gone(v1)
    assert v1.state is VersionState.UNLOADED and registry.get("tagger", 1) is None
    with pytest.raises(IllegalMove):
        registry.gone(registry.serving("tagger"))  # type: ignore[arg-type]  # still serves
    v2 = registry.serving("tagger")
    assert v2 is not None
    registry.renumber(v2, 3)  # the same export published again as version 3
    assert registry.get("tagger", 3) is v2 and registry.get("tagger", 2) is None


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
    assert v1.state is VersionState.DRAINING and registry.names() == []
    with pytest.raises(ModelNotFound):
        registry.resolve("tagger")
    assert registry.retire("tagger") is None
    # Replaced in place: 503 until the next version serves.
    _serving(registry, "tagger", 2, "t@2")
    registry.retire("tagger", coming_back=True)
    with pytest.raises(NotReady):
        registry.resolve("tagger")


def test_a_move_refused_leaves_the_version_as_it_was() -> None:
    registry = ModelRegistry()
    v1 = _serving(registry, "tagger", 1, "t@1")
    with pytest.raises(IllegalMove):
        registry.ready(v1, MANIFEST, OTHER)  # serving: not loading
    assert v1.predictor is PREDICTOR and _state(v1) is VersionState.SERVING


def test_a_pin_while_its_name_serves_nothing_yet_is_503_as_unpinned() -> None:
    """A regression: at a start or in a replace's gap, a request pinned by ``X-Model-Id``
    got 409 (final, to a client) where the same request unpinned got 503 with
    Retry-After; and a broker front end refreshes its view only on 503."""
    registry = ModelRegistry()
    registry.expect(["tagger"])
    for name in ("tagger", None):
        with pytest.raises(NotReady):
            registry.resolve(name)
        with pytest.raises(NotReady) as refused:
            registry.resolve(name, pinned="t@1")
        assert refused.value.retry_after_s == 2
    _serving(registry, "tagger", 1, "t@1")
    with pytest.raises(ModelVersionUnavailable):  # served now: another id is not
        registry.resolve("tagger", pinned="t@2")
    with pytest.raises(ModelNotFound):
        registry.resolve("other", pinned="t@1")


def test_a_model_is_ready_whatever_another_name_s_state() -> None:
    """A regression: ``/v2/models/A/ready`` and gRPC ``ModelReady`` asked whether every
    name served (``Engine.serves``): A said not ready, while A's requests got 200, as long
    as another name's version had no ready worker."""
    from types import SimpleNamespace

    from app.engine import Engine

    registry = ModelRegistry()
    a1, b1 = _serving(registry, "a", 1, "a@1"), _serving(registry, "b", 1, "b@1")
    held = {"a@1"}  # b's one worker died
    view = SimpleNamespace(answers=lambda served_id: served_id in held)
    engine: Any = Engine.__new__(Engine)
    engine.registry = registry
    engine._transport = SimpleNamespace(ready=True, models=SimpleNamespace(view=view))
    assert engine.answers_for(a1) and not engine.answers_for(b1)
    assert not engine.serves()  # /readyz: every name's
    a2 = registry.loading("a", 2, "a@2")
    registry.ready(a2, MANIFEST, PREDICTOR)
    held.update({"a@2", "b@1"})
    assert not engine.answers_for(a2) and engine.serves()  # ready, not serving yet


async def test_a_version_rolled_back_and_draining_again_gets_its_whole_drain() -> None:
    """A regression: the wait of its first drain, still running after a rollback served
    it again, ended that drain's time after it began and let it go while the second drain
    had requests in flight (the workers then unload it under them)."""
    from app.services.models import Drains

    registry = ModelRegistry()
    v1 = _serving(registry, "t", 1, "t@1")
    drains = Drains(registry, timeout_s=0.4)
    with registry.admit("t"):  # a long request of v1's, over both its drains
        v2 = registry.loading("t", 2, "t@2")
        registry.ready(v2, MANIFEST, PREDICTOR)
        drains.later(registry.switch(v2))  # v1 drains: that wait ends at 0.4 s
        await asyncio.sleep(0.2)
        drains.later(registry.switch(v1))  # rolled back: v1 serves again, v2 goes
        v3 = registry.loading("t", 3, "t@3")
        registry.ready(v3, MANIFEST, PREDICTOR)
        drains.later(registry.switch(v3))  # v1 drains again at 0.2 s: until 0.6 s
        await asyncio.sleep(0.3)  # 0.5 s: past the first drain's end
        assert _state(v1) is VersionState.DRAINING
    await asyncio.sleep(0.05)
    assert _state(v1) is VersionState.UNLOADED  # answered: let go
    await drains.aclose()
