"""What the admin routes' load asks (``app.v2.server.load_asked``, ``Models.load``), refused
as a client error before anything changes."""

from __future__ import annotations

from pathlib import Path
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
