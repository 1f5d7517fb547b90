"""What the admin routes' load asks (``app.v2.server.load_asked``, ``Models.load``), refused
as a client error before anything changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.errors import InvalidRequest, ModelVersionUnavailable
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


async def test_a_load_the_workers_gave_up_at_its_deadline_leaves_a_new_name_unknown() -> None:
    """A regression: a name loaded for the first time (or after an unload) whose load the
    workers gave up at step ``timeout`` (a load past ``MB_WORKER_START_TIMEOUT``) stayed
    known with nothing coming: 503 with Retry-After for ever, not 404; only this call's
    own deadline (the workers still loading) leaves it coming."""
    from types import SimpleNamespace

    from app.broker.wire.heartbeat import WorkerInfo
    from app.errors import ModelLoadFailed, ModelNotFound

    late = WorkerInfo.model_validate(
        {
            "name": "a:0", "host": "h", "index": 0, "pid": 1, "device": "cpu", "threads": 1,
            "batch_size": 8, "ready": True, "alive": True, "running": 0, "restarts": 0,
            "batches": 0, "items": 0, "mixed_batches": 0, "expired": 0, "malformed": 0,
            "reclaimed": 0, "given_up": 0, "draining": False, "aimed": 1,
            "models": [{"name": "tagger", "version": 1, "served_id": "t@1", "state": "failed",
                        "step": "timeout", "reason": "not loaded after 300 s"}],
        }
    )  # fmt: skip

    async def pin(name: str, pin: object) -> int:
        return 1

    async def refresh() -> None:
        return None

    read = SimpleNamespace(manifest=SimpleNamespace(model_id="t"))
    repository: Any = SimpleNamespace(read=lambda *args, **kwargs: read, root=Path("/nowhere"))
    control: Any = SimpleNamespace(pin=pin, refresh=refresh, view=SimpleNamespace(workers=[late]))
    registry = ModelRegistry()
    models = Models(
        registry, repository, control, NOTHING, dtype="auto", drain_timeout_s=1, load_timeout_s=1
    )
    with pytest.raises(ModelLoadFailed) as failed:
        await models.load("tagger", 1)
    assert failed.value.step == "timeout"
    with pytest.raises(ModelNotFound):
        registry.resolve("tagger")


async def test_the_serving_number_held_at_another_precision_is_served_under_that_id() -> None:
    """A regression: the workers' route for the serving version number moved to its other
    precision (``+bf16`` and back: a mixed fleet, or a front end's own reading replaced by
    the workers'). The registry returned the serving row, ``ready`` swapped its predictor
    and then refused the move: answers computed by one export carried the other's id, and
    the name's follow raised at every look. Now the row's id and predictor change together,
    both ways, and a draining one serves again."""
    from types import SimpleNamespace

    from app.lifecycle import Route, VersionState

    def read(name: str, version: int, *args: Any, **kwargs: Any) -> Any:
        return SimpleNamespace(manifest=SimpleNamespace(model_id=f"t@{version}"), classes=["a"])

    repository: Any = SimpleNamespace(read=read, names=lambda: ["tagger"], root=Path("/nowhere"))
    made: list[str] = []

    def make(manifest: object, classes: object, served_id: str) -> Any:
        made.append(served_id)
        return SimpleNamespace(model_id=served_id)

    registry = ModelRegistry()
    models = Models(registry, repository, NOTHING, make, dtype="auto", drain_timeout_s=1,
                    load_timeout_s=1)  # fmt: skip

    def route(served_id: str, number: int = 3) -> None:
        view: Any = SimpleNamespace(pins={}, routes={"tagger": Route(number, served_id)})
        models.follow(view)

    def computing(version: Any) -> str:
        return str(version.predictor.model_id)  # the id its predictor's batches carry

    route("t@3")
    with registry.admit("tagger") as first:  # a request admitted before: its predictor stays
        held: Any = first.predictor
        route("t@3+bf16")
        serving: Any = registry.serving("tagger")
        assert serving is first and serving.served_id == "t@3+bf16"
        assert serving.predictor is not held and computing(serving) == "t@3+bf16"
        assert held.model_id == "t@3"
    assert len(registry.versions()) == 1 and serving.state is VersionState.SERVING
    with pytest.raises(ModelVersionUnavailable):
        registry.resolve("tagger", pinned="t@3")
    route("t@3")  # and back
    assert computing(registry.resolve("tagger")) == "t@3"
    route("t@4", 4)  # a new version: 3 drains; then 3 at its other precision comes back
    assert registry.get("tagger", 3).state is VersionState.DRAINING  # type: ignore[union-attr]
    route("t@3+bf16")
    back = registry.resolve("tagger")
    assert (back.version, back.served_id, computing(back)) == (3, "t@3+bf16", "t@3+bf16")
    assert registry.get("tagger", 4).state is VersionState.DRAINING  # type: ignore[union-attr]
    assert made == ["t@3", "t@3+bf16", "t@3", "t@4", "t@3+bf16"]
    await models.aclose()
