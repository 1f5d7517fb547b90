"""``app.lifecycle.keeper``: the lifecycle's steps for one worker, without processes: what it
loads when aimed (at start-up as at any load), in what order, what it never retries on a
poll, the rollbacks (one form: an export held already is held under the new number), one
export under two names, and when it drains, stops reading and unloads."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from app.errors import ModelStoreError
from app.lifecycle import UNKNOWN, ModelSpec, Route, VersionLife, VersionState
from app.lifecycle.keeper import Effect, Keeper

EXPORTS = {1: "t@aaa", 2: "t@bbb", 3: "t@ccc", 4: "t@aaa"}  # version 4: version 1 again


def spec(number: int, name: str = "tagger") -> ModelSpec:
    return ModelSpec(name, number, f"/m/{name}/{number}", EXPORTS[number])


class Disk:
    """The repository as a keeper's driver reads it; ``corrupt`` versions fail to verify."""

    def __init__(self, corrupt: Sequence[int] = ()) -> None:
        self.corrupt = set(corrupt)
        self.reads: list[tuple[str, int, bool]] = []

    def __call__(self, name: str, number: int, verify: bool) -> ModelSpec:
        self.reads.append((name, number, verify))
        if verify and number in self.corrupt:
            raise ModelStoreError(f"{name} {number} does not match its sha256")
        return spec(number, name)


@dataclass
class Worker:
    """Another worker as its heartbeat says."""

    name: str
    models: list[VersionLife] = field(default_factory=list)
    alive: bool = True
    draining: bool = False
    aimed: int = 0


def life(number: int, state: VersionState, name: str = "tagger") -> VersionLife:
    held = VersionLife(name, number, EXPORTS[number])
    held.state = state
    return held


def load_all(keeper: Keeper, bf16: bool = False) -> list[ModelSpec]:
    """Run every queued load to success (held in bf16 when ``bf16``)."""
    done = []
    while (next_one := keeper.next_load()) is not None:
        keeper.begin(next_one)
        held = next_one.decided("bfloat16", next_one.served_id + "+bf16") if bf16 else next_one
        keeper.loaded(next_one, held)
        done.append(next_one)
    return done


def view(keeper: Keeper, *others: Worker) -> list[Worker]:
    return [Worker(keeper.name, keeper.held()), *others]


def states(keeper: Keeper) -> list[tuple[int, str]]:
    return [(held.version, held.state.value) for held in keeper.held()]


def never_empty(served_id: str) -> bool:
    return False


def empty(served_id: str) -> bool:
    return True


def test_a_worker_starts_with_nothing_and_loads_its_targets_as_any_load() -> None:
    keeper = Keeper("w0")
    keeper.aim({"tagger": 2, "other": 1}, Disk(), explicit=False)
    loaded = load_all(keeper, bf16=True)
    assert [(s.name, s.version) for s in loaded] == [("tagger", 2), ("other", 1)]
    # Held under the id the load gave it (its precision), by name and number.
    assert [(h.name, h.version, h.served_id) for h in keeper.held()] == [
        ("other", 1, "t@aaa+bf16"),
        ("tagger", 2, "t@bbb+bf16"),
    ]
    assert keeper.holds("t@bbb+bf16") and not keeper.holds("t@bbb")


def test_beside_workers_mid_rollout_it_loads_what_they_serve_first_then_the_target() -> None:
    keeper = Keeper("w1")
    serving = {"tagger": Route(1, "t@aaa")}
    keeper.aim({"tagger": 2}, Disk(), explicit=False, serving=serving)
    assert [s.version for s in load_all(keeper)] == [1, 2]
    gave_up = Keeper("w2")
    gave_up.aim({"tagger": 2}, Disk(), explicit=False, serving=serving, gave_up=[("tagger", 2)])
    assert [s.version for s in load_all(gave_up)] == [1]


def test_a_poll_never_retries_a_failure_and_an_explicit_aim_does() -> None:
    keeper = Keeper("w0")
    keeper.aim({"tagger": 2}, Disk(), explicit=False)
    failing = keeper.next_load()
    assert failing is not None
    keeper.begin(failing)
    keeper.failed_load(failing, "verify", "bad sha256")
    assert states(keeper) == [(2, "failed")] and keeper.loading is None
    keeper.aim({"tagger": 2}, Disk(), explicit=False)  # a poll
    assert keeper.next_load() is None and states(keeper) == [(2, "failed")]
    keeper.aim({"tagger": 2}, Disk(), explicit=True)  # SIGHUP, the admin route
    assert keeper.next_load() == spec(2)
    keeper.aim({"tagger": 3}, Disk(), explicit=False)  # a newer target: the failure is moot
    assert all(held.version != 2 for held in keeper.held())


def test_a_poll_tries_again_a_failure_whose_files_changed_since(tmp_path: Path) -> None:
    """A copy into the repository read before it was finished (its manifest there, its
    weights still coming) failed to verify; a poll never tried it again, so the version
    never served until a SIGHUP. Once its files change, a poll tries it again."""
    store = tmp_path / "tagger" / "2"
    store.mkdir(parents=True)
    (store / "manifest.json").write_text("{}")
    (store / "model.pt").write_bytes(b"half")
    copied = ModelSpec("tagger", 2, str(store), EXPORTS[2])
    keeper = Keeper("w0")
    keeper.aim({"tagger": 2}, lambda name, number, verify: copied, explicit=False)
    failing = keeper.next_load()
    assert failing is not None
    keeper.begin(failing)
    keeper.failed_load(failing, "verify", "bad sha256")
    keeper.aim({"tagger": 2}, lambda name, number, verify: copied, explicit=False)  # a poll
    assert keeper.next_load() is None  # nothing changed: not tried again
    (store / "model.pt").write_bytes(b"half and the rest")  # the copy finished
    keeper.aim({"tagger": 2}, lambda name, number, verify: copied, explicit=False)
    assert keeper.next_load() == copied


def failed_on(name: str, number: int, aimed: int) -> Worker:
    """Another worker whose load of ``number`` failed, as it said after request ``aimed``."""
    failure = life(number, VersionState.FAILED)
    failure.step, failure.reason = "verify", "bad sha256"
    return Worker(name, [life(1, VersionState.READY), failure], aimed=aimed)


def test_a_version_the_others_gave_up_is_not_loaded_again() -> None:
    keeper = Keeper("w0")
    keeper.aim({"tagger": 2}, Disk(), explicit=False, asked=1)
    assert keeper.next_load([failed_on("w1", 2, aimed=1)]) is None and not keeper.queue
    also = Keeper("w0")
    also.aim({"tagger": 2}, Disk(), explicit=False)
    assert also.next_load(also=[("tagger", 2)]) is None  # given up besides (a crash)


def test_an_explicit_aim_of_the_same_number_tries_once_what_the_others_failed() -> None:
    """A SIGHUP of one host in broker mode aims its workers again under the same request
    number as the last attempt: the other worker's failure from that attempt does not stop
    this one from trying once (before, each read the other's failure as the version given
    up, and none tried it again); a poll (not explicit) does not try it."""
    other = failed_on("w1", 2, aimed=1)
    keeper = Keeper("w0")
    keeper.aim({"tagger": 2}, Disk(), explicit=False, asked=1)
    assert keeper.next_load([other]) is None
    keeper.aim({"tagger": 2}, Disk(), explicit=False, asked=1)  # a poll
    assert keeper.next_load([other]) is None
    keeper.aim({"tagger": 2}, Disk(), explicit=True, asked=1)  # SIGHUP
    assert keeper.next_load([other]) == spec(2)
    keeper.begin(spec(2))
    keeper.failed_load(spec(2), "verify", "bad sha256")
    keeper.aim({"tagger": 2}, Disk(), explicit=False, asked=1)
    assert keeper.next_load([other]) is None  # once: then given up again


def test_a_retry_is_not_answered_by_the_failures_of_the_attempt_before() -> None:
    """Asked again (request 2) after a failure (request 1): another worker's failure from
    request 1 does not stop this load, nor drain what it loaded; one from request 2 does."""
    keeper = Keeper("w0")
    keeper.aim({"tagger": 1}, Disk(), explicit=False, asked=0)
    load_all(keeper)
    keeper.aim({"tagger": 2}, Disk(), explicit=True, asked=2)
    stale = failed_on("w1", 2, aimed=1)
    assert keeper.next_load([stale]) == spec(2)
    keeper.begin(spec(2))
    keeper.loaded(spec(2), spec(2))
    keeper.settle(view(keeper, stale), time.monotonic() + 1, empty)
    assert ("tagger", 2) in keeper.lives and keeper.lives[("tagger", 2)].state.value == "ready"
    keeper.settle(view(keeper, failed_on("w1", 2, aimed=2)), time.monotonic() + 1, empty)
    assert keeper.lives[("tagger", 2)].state.value == "draining"


def test_a_rollback_written_as_the_next_version_is_held_with_no_load() -> None:
    keeper = Keeper("w0")
    keeper.aim({"tagger": 1}, Disk(), explicit=False)
    load_all(keeper, bf16=True)
    keeper.aim({"tagger": 4}, Disk(), explicit=True)  # version 4 is version 1's export
    assert keeper.next_load() is None  # nothing to load
    assert states(keeper) == [(1, "ready"), (4, "ready")]
    held = {h.version: h.served_id for h in keeper.held()}
    assert held == {1: "t@aaa+bf16", 4: "t@aaa+bf16"}  # in the precision it is held in
    # The name moves to 4; 1 drains and just goes: its export is still held, as 4.
    routes = [Worker("w0", keeper.held())]
    effects = keeper.settle(routes, 10.0, empty)
    assert effects == [] and states(keeper) == [(4, "ready")]


def test_a_copy_that_does_not_verify_fails_on_its_own_row_and_nothing_else_moves() -> None:
    """It fails with no load, and says so as a load would: logged (``on_error``) and told
    to the driver (``on_failed``), which counts it with the loads that failed (it was
    silent: make chaos's random sequences waited for the count)."""
    said: list[str] = []
    told: list[tuple[int, str]] = []
    keeper = Keeper("w0", on_error=said.append,
                    on_failed=lambda spec, step: told.append((spec.version, step)))  # fmt: skip
    keeper.aim({"tagger": 1}, Disk(), explicit=False)
    load_all(keeper)
    keeper.aim({"tagger": 4}, Disk(corrupt=[4]), explicit=True)
    assert states(keeper) == [(1, "ready"), (4, "failed")]
    assert keeper.failed[("tagger", 4)].step == "verify"
    assert told == [(4, "verify")] and len(said) == 1 and "sha256" in said[0]
    assert keeper.settle(view(keeper), 10.0, empty) == [] and states(keeper)[0] == (1, "ready")


def test_one_export_under_two_names_is_loaded_once_and_unloaded_once_neither_holds_it() -> None:
    keeper = Keeper("w0")
    keeper.aim({"a": 1, "b": 1}, Disk(), explicit=False)
    assert [s.name for s in load_all(keeper)] == ["a"]  # b's is the same export
    assert [(h.name, h.state.value) for h in keeper.held()] == [("a", "ready"), ("b", "ready")]
    keeper.aim({"a": 1, "b": None}, Disk(), explicit=True)  # b unloaded
    assert keeper.settle(view(keeper), 10.0, empty) == []  # a still holds it
    assert [h.name for h in keeper.held()] == ["a"]
    keeper.aim({"a": None, "b": None}, Disk(), explicit=True)
    now = time.monotonic() + 1  # on the clock a version's state changes are stamped with
    assert keeper.settle(view(keeper), now, empty) == [Effect("unread", "t@aaa")]
    assert keeper.settle(view(keeper), now, empty) == [Effect("unload", "t@aaa")]
    assert keeper.held() == []


def moved_to_version_2() -> Keeper:
    """A keeper that served version 1 and holds version 2 ready, as every worker does: 1
    drains."""
    keeper = Keeper("w0", grace_s=3.0, retire_s=2.5)
    keeper.aim({"tagger": 1}, Disk(), explicit=False)
    load_all(keeper)
    keeper.aim({"tagger": 2}, Disk(), explicit=True)
    load_all(keeper)
    keeper.settle(view(keeper), keeper.lives[("tagger", 1)].since, empty)
    return keeper


def test_what_its_name_moved_from_drains_then_stops_being_read_then_unloads() -> None:
    keeper = moved_to_version_2()
    start = keeper.lives[("tagger", 1)].since
    assert states(keeper) == [(1, "draining"), (2, "ready")]
    assert keeper.settle(view(keeper), start + 1.0, empty) == []  # within the grace
    later = keeper.lives[("tagger", 1)].since + 3.0
    assert keeper.settle(view(keeper), later, never_empty) == []  # work still comes
    assert keeper.settle(view(keeper), later, empty) == [Effect("unread", "t@aaa")]
    assert keeper.settle(view(keeper), later + 1.0, empty) == []
    # Work came back meanwhile: read again; once done, stopped and unloaded.
    assert keeper.settle(view(keeper), later + 2.5, never_empty) == [Effect("read", "t@aaa")]
    assert keeper.settle(view(keeper), later + 3.0, empty) == [Effect("unread", "t@aaa")]
    assert keeper.settle(view(keeper), later + 6.0, empty) == [Effect("unload", "t@aaa")]
    assert states(keeper) == [(2, "ready")]


def test_an_export_no_longer_read_is_read_again_once_a_new_number_holds_it() -> None:
    """Version 1 drained and stopped being read; version 4, the same export written as the
    next version before version 1 unloads, is held with no load, and its work is read again
    (found by make chaos: its requests waited in a stream no worker read, 504 after 30 s)."""
    keeper = moved_to_version_2()
    later = keeper.lives[("tagger", 1)].since + 3.0
    assert keeper.settle(view(keeper), later, empty) == [Effect("unread", "t@aaa")]
    keeper.aim({"tagger": 4}, Disk(), explicit=True)
    assert load_all(keeper) == []  # held already, as version 1
    two = keeper.lives[("tagger", 2)].since
    assert keeper.settle(view(keeper), two, empty) == [Effect("read", "t@aaa")]
    assert states(keeper) == [(2, "draining"), (4, "ready")]
    # Version 2 goes its way; version 4's export is read from now on, and never unloaded.
    two = keeper.lives[("tagger", 2)].since
    effects = [keeper.settle(view(keeper), two + t, empty) for t in (3.0, 6.0, 9.0)]
    assert effects == [[Effect("unread", "t@bbb")], [Effect("unload", "t@bbb")], []]
    assert states(keeper) == [(4, "ready")]


def test_a_version_still_loading_elsewhere_keeps_the_old_one_however_long_it_takes() -> None:
    keeper = Keeper("w0")
    keeper.aim({"tagger": 1}, Disk(), explicit=False)
    load_all(keeper)
    keeper.aim({"tagger": 2}, Disk(), explicit=True)
    load_all(keeper)
    slow = Worker("w1", [life(1, VersionState.READY), life(2, VersionState.LOADING)])
    for now in (10.0, 100.0, 1000.0):
        assert keeper.settle(view(keeper, slow), now, empty) == []
        assert states(keeper) == [(1, "ready"), (2, "ready")]


def test_a_rollback_by_the_route_withdraws_the_newer_version_once_the_older_is_ready() -> None:
    keeper = Keeper("w0")
    keeper.aim({"tagger": 2}, Disk(), explicit=False)
    load_all(keeper)
    keeper.aim({"tagger": 1}, Disk(), explicit=True)
    load_all(keeper)
    keeper.settle(view(keeper), 10.0, empty)
    assert states(keeper) == [(1, "ready"), (2, "draining")]
    assert keeper.lives[("tagger", 2)].reason == "withdrawn: version 1 is chosen now"


@pytest.mark.parametrize(
    ("target", "reason"),
    [(None, "unloaded by the admin route"), (2, "given up: w1: verify: bad sha256")],
)
def test_an_unloaded_name_or_a_version_given_up_drains(target: int | None, reason: str) -> None:
    keeper = Keeper("w0")
    keeper.aim({"tagger": 2}, Disk(), explicit=False)
    load_all(keeper)
    keeper.aim({"tagger": target}, Disk(), explicit=True)
    failed = life(2, VersionState.FAILED)
    failed.step, failed.reason = "verify", "bad sha256"
    other = Worker("w1", [life(1, VersionState.READY), failed])
    if target is None:
        other.models = []
    keeper.settle(view(keeper, other), 10.0, empty)
    assert keeper.lives[("tagger", 2)].state is VersionState.DRAINING
    assert keeper.lives[("tagger", 2)].reason == reason


def test_a_name_whose_target_cannot_be_read_keeps_what_it_holds() -> None:
    keeper = Keeper("w0")
    keeper.aim({"tagger": 1}, Disk(), explicit=False)
    load_all(keeper)
    keeper.aim({"tagger": UNKNOWN}, Disk(), explicit=True)
    keeper.settle(view(keeper), 10.0, empty)
    assert states(keeper) == [(1, "ready")]


def test_a_stopping_worker_leaves_once_others_hold_what_it_holds_or_the_name_moved() -> None:
    keeper = Keeper("w0", grace_s=3.0)
    keeper.aim({"tagger": 1}, Disk(), explicit=False)
    load_all(keeper)
    alone: list[Worker] = []
    assert keeper.drained(alone, 0.0, 0.0, never_empty)  # nobody to hand over to
    holding = [Worker("w1", [life(1, VersionState.READY)])]
    assert keeper.drained(holding, 0.0, 0.0, never_empty)
    moved = [Worker("w1", [life(2, VersionState.READY)])]
    assert not keeper.drained(moved, 0.0, 1.0, empty)  # within the grace
    assert not keeper.drained(moved, 0.0, 5.0, never_empty)  # its stream still has work
    assert keeper.drained(moved, 0.0, 5.0, empty)
