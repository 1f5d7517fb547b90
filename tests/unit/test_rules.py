"""``app.lifecycle``: the states and their moves, and the rules every process asks: which
version a name should serve, which it serves now from the workers' heartbeats, when a
rollout is given up, and what a worker does with each version it holds."""

from __future__ import annotations

from itertools import product
from typing import Any

import pytest

from app.broker.wire.heartbeat import WorkerInfo
from app.errors import ModelNotFound
from app.lifecycle import (
    UNKNOWN,
    UNLOADED,
    Fate,
    IllegalMove,
    Route,
    VersionLife,
    VersionState,
    chosen_version,
    fate,
    followed,
    given_up,
    routes,
)
from app.lifecycle.states import MOVES


def worker(name: str, *models: tuple[Any, ...], draining: bool = False, **extra: Any) -> WorkerInfo:
    """A heartbeat holding tagger versions, as (version, state[, step, reason]) tuples."""
    return WorkerInfo.model_validate(
        {
            "name": name, "host": "h", "index": 0, "pid": 1, "device": "cpu", "threads": 1,
            "batch_size": 8, "ready": True, "alive": True, "running": 0, "restarts": 0,
            "batches": 0, "items": 0, "mixed_batches": 0, "expired": 0, "malformed": 0,
            "reclaimed": 0, "given_up": 0, "draining": draining,
            "models": [
                {"name": "tagger", "version": m[0], "served_id": f"t@{m[0]}", "state": m[1],
                 "step": m[2] if len(m) > 2 else "", "reason": m[3] if len(m) > 3 else ""}
                for m in models
            ],
            **extra,
        }
    )  # fmt: skip


V1, V2 = Route(1, "t@1"), Route(2, "t@2")

# -- the states ------------------------------------------------------------------------------


@pytest.mark.parametrize(("start", "to"), list(product(VersionState, VersionState)))
def test_every_move_the_diagram_has_is_allowed_and_no_other(
    start: VersionState, to: VersionState
) -> None:
    life = VersionLife("tagger", 1, "t@1", start)
    if to in MOVES[start]:
        life.move(to, "step", "why")
        assert (life.state, life.step, life.reason) == (to, "step", "why")
    else:
        with pytest.raises(IllegalMove, match=f"cannot become {to.value}"):
            life.move(to)
        assert life.state is start


def test_a_serving_version_shows_as_ready_and_only_held_states_hold_memory() -> None:
    assert VersionState.SERVING.shown == "ready" and VersionState.ON_DISK.shown == "unavailable"
    held = {state for state in VersionState if state.holds_models}
    assert held == {"loading", "ready", "serving", "draining"}


# -- which version a name should serve --------------------------------------------------------


def test_the_target_is_the_admin_route_s_else_the_pin_else_the_newest() -> None:
    assert chosen_version("tagger", [1, 2, 3]) == 3
    assert chosen_version("tagger", [1, 2, 3], pin=1) == 1
    assert chosen_version("tagger", [1, 2, 3], pin=1, admin=2) == 2
    assert chosen_version("tagger", [1, 2, 3], pin=1, admin=UNLOADED) is None
    with pytest.raises(ModelNotFound, match="admin route loaded tagger=7, but it has versions 1"):
        chosen_version("tagger", [1], admin=7)
    with pytest.raises(ModelNotFound, match="no model named 'tagger'"):
        chosen_version("tagger", [])


# -- which version it serves now -------------------------------------------------------------


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


def test_draining_and_dead_workers_and_draining_versions_do_not_count() -> None:
    old = worker("a:0", (1, "ready"), draining=True)
    new = worker("b:0", (2, "ready"))
    assert routes([old, new]) == {"tagger": V2}
    assert routes([worker("a:0", (1, "ready"), alive=False), new]) == {"tagger": V2}
    withdrawn = [worker("a:0", (1, "ready"), (2, "draining")), worker("b:0", (1, "ready"))]
    assert routes(withdrawn) == {"tagger": V1}


def test_a_split_says_nothing_to_workers_and_keeps_a_front_end_where_it_was() -> None:
    split = [worker("a:0", (1, "ready")), worker("b:0", (2, "ready"))]
    assert routes(split) == {}
    assert routes(split, sticky={"tagger": V1}) == {"tagger": V1}
    assert routes(split, sticky={"tagger": V2}) == {"tagger": V2}
    # The sticky version gone from every worker: the front end takes what is ready most.
    three = [*split, worker("c:0", (2, "ready"))]
    assert routes(three, sticky={"tagger": Route(0, "t@0")}) == {"tagger": V2}


# -- when a rollout is given up --------------------------------------------------------------


def test_a_rollout_is_given_up_only_when_a_failure_leaves_too_few_workers_to_switch() -> None:
    a = worker("a:0", (1, "ready"), (2, "ready"))
    slow = worker("b:0", (1, "ready"), (2, "loading"))
    failed = worker("b:0", (1, "ready"), (2, "failed", "self-test", "cosine 0.2"))
    assert given_up([a, slow]) == {}  # loading, however long it takes: never a timer
    assert given_up([a, failed]) == {("tagger", 2): "b:0: self-test: cosine 0.2"}
    assert given_up([a, failed], min_workers=1) == {}  # a is enough on its own
    timed_out = worker("b:0", (1, "ready"), (2, "failed", "timeout", "not loaded after 300 s"))
    assert given_up([a, timed_out]) == {("tagger", 2): "b:0: timeout: not loaded after 300 s"}
    # A failed worker that died, or that is stopping, no longer counts.
    assert given_up([a, worker("b:0", (2, "failed", "load", "x"), alive=False)]) == {}


# -- what a worker does with each version it holds -------------------------------------------


def _fate(version: int, **given: Any) -> Fate:
    held = VersionLife("tagger", version, f"t@{version}", VersionState.READY)
    decided: Fate = fate(held, **{"target_ready": True, "route_held": True, **given})
    return decided


def test_a_newer_version_still_loading_elsewhere_is_kept_however_long_it_takes() -> None:
    """The bug of 2026-11-27: a worker retired the new version 5.5 s after loading it, while
    the other still loaded it (the rule served the old one meanwhile)."""
    assert _fate(2, route=V1, target=2) is Fate.KEEP
    assert _fate(1, route=V1, target=2) is Fate.KEEP  # the old one serves on meanwhile


def test_a_worker_drains_what_its_name_moved_from_or_gave_up() -> None:
    assert _fate(1, route=V2, target=2) is Fate.DRAIN  # moved on
    assert _fate(2, route=V1, target=2, gave_up=True) is Fate.DRAIN  # failed elsewhere
    assert _fate(2, route=Route(3, "t@3"), target=3) is Fate.DRAIN  # a newer version
    assert _fate(1, route=V1, target=None) is Fate.DRAIN  # unloaded by the admin route


def test_a_rollback_withdraws_the_newer_version_once_the_chosen_one_is_ready() -> None:
    assert _fate(3, route=Route(3, "t@3"), target=2, target_ready=False) is Fate.KEEP
    assert _fate(3, route=Route(3, "t@3"), target=2, target_ready=True) is Fate.DRAIN


def test_a_worker_keeps_what_it_has_while_the_rule_says_nothing_or_it_lacks_the_route() -> None:
    assert _fate(1, route=None, target=2) is Fate.KEEP  # a rolling restart's split
    assert _fate(1, route=V2, target=2, route_held=False) is Fate.KEEP  # all it has of it


# -- a worker restarted after a crash ----------------------------------------------------------


def on_disk(*versions: int) -> Any:
    return lambda name: versions


@pytest.mark.parametrize(
    ("others", "disk", "target", "decided", "want"),
    [
        # What the others hold, not the newest on disk (published, no reload asked).
        ([worker("w1", (1, "ready"), targets={"tagger": 1})], (1, 2), 2, (), 1),
        # A rollout in progress: one loads it, another has it queued (only its aim says).
        ([worker("w1", (1, "ready"), (2, "loading"))], (1, 2), 2, (), 2),
        ([worker("w1", (1, "ready"), targets={"tagger": 2})], (1, 2), 2, (), 2),
        # Older heartbeats (no targets): what they hold.
        ([worker("w1", (1, "ready"))], (1, 2, 3), 3, (), 1),
        # Their aim gone from disk here (a rollback by deleting it): its own target.
        ([worker("w1", (3, "ready"), targets={"tagger": 3})], (1, 2), 2, (), 2),
        # A draining worker is not followed; nobody else: its own target.
        ([worker("w1", (1, "ready"), draining=True)], (1, 2), 2, (), 2),
        # A pin decides; an unloaded name and one it cannot read stay as they are.
        ([worker("w1", (1, "ready"))], (1, 2), 2, ("tagger",), 2),
        ([worker("w1", (1, "ready"))], (1, 2), None, ("tagger",), None),
        ([worker("w1", (1, "ready"))], (1, 2), UNKNOWN, (), UNKNOWN),
        # What they hold as failed or draining is not an aim.
        ([worker("w1", (2, "failed", "verify", "bad"), (1, "ready"))], (1, 2), 2, (), 1),
    ],
)
def test_a_restarted_worker_follows_what_the_others_were_aimed_at(
    others: list[WorkerInfo],
    disk: tuple[int, ...],
    target: int | None,
    decided: tuple[str, ...],
    want: int | None,
) -> None:
    assert followed({"tagger": target}, decided, others, on_disk(*disk)) == {"tagger": want}
