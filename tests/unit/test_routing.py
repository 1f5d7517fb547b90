"""``app.broker.routing``: which version a name serves, from the workers' heartbeats."""

from __future__ import annotations

from typing import Any

from app.broker.routing import routes
from app.broker.wire import WorkerInfo
from app.repository import Route


def worker(name: str, *models: tuple[int, str], draining: bool = False, **extra: Any) -> WorkerInfo:
    """A heartbeat holding tagger versions, as (version, state) pairs."""
    return WorkerInfo.model_validate(
        {
            "name": name, "host": "h", "index": 0, "pid": 1, "device": "cpu", "threads": 1,
            "batch_size": 8, "ready": True, "alive": True, "running": 0, "restarts": 0,
            "batches": 0, "items": 0, "mixed_batches": 0, "expired": 0, "malformed": 0,
            "reclaimed": 0, "given_up": 0, "draining": draining,
            "models": [
                {"name": "tagger", "version": v, "served_id": f"t@{v}", "state": state}
                for v, state in models
            ],
            **extra,
        }
    )  # fmt: skip


V1, V2 = Route(1, "t@1"), Route(2, "t@2")


def test_a_name_moves_once_the_new_version_is_ready_on_every_worker() -> None:
    a = worker("a:0", (1, "ready"), (2, "ready"))
    assert routes([a, worker("b:0", (1, "ready"))]) == {"tagger": V1}
    assert routes([a, worker("b:0", (1, "ready"), (2, "loading"))]) == {"tagger": V1}
    assert routes([a, worker("b:0", (1, "ready"), (2, "failed"))]) == {"tagger": V1}
    assert routes([a, worker("b:0", (1, "ready"), (2, "ready"))]) == {"tagger": V2}


def test_fewer_workers_may_be_enough_when_asked() -> None:
    a = worker("a:0", (1, "ready"), (2, "ready"))
    b = worker("b:0", (1, "ready"))
    assert routes([a, b], min_workers=1) == {"tagger": V2}


def test_draining_and_dead_workers_do_not_count() -> None:
    old = worker("a:0", (1, "ready"), draining=True)
    new = worker("b:0", (2, "ready"))
    assert routes([old, new]) == {"tagger": V2}
    assert routes([worker("a:0", (1, "ready"), alive=False), new]) == {"tagger": V2}


def test_a_split_says_nothing_to_workers_and_keeps_a_front_end_where_it_was() -> None:
    split = [worker("a:0", (1, "ready")), worker("b:0", (2, "ready"))]
    assert routes(split) == {}
    assert routes(split, sticky={"tagger": V1}) == {"tagger": V1}
    assert routes(split, sticky={"tagger": V2}) == {"tagger": V2}
    # The sticky version gone from every worker: the front end takes what is ready most.
    three = [*split, worker("c:0", (2, "ready"))]
    assert routes(three, sticky={"tagger": Route(0, "t@0")}) == {"tagger": V2}
