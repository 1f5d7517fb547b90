"""The rules of a version's life, asked by every process that serves (no I/O, no clocks but
the ones passed in): which version a name should serve, which version it serves now across
the workers, when a rollout is given up, and what a worker does with each version it holds.

**Which version a name should serve** (``chosen_version``, its *target*): the version an
operator loaded by the admin route, else its ``MB_MODEL_VERSIONS`` pin, else its newest on
disk; none once the operator unloaded it.

**Which version it serves now** (``routes``), over the live workers that are not stopping
and hold some version of the name (loading or ready): the newest version ready on enough of
them (every one by default; ``MB_SWITCH_MIN_WORKERS=N``: N). A version still loading
somewhere is not ready everywhere yet, so a name moves once the new version is ready where
it must be, however long its loads take. When no version is ready on enough workers (a
rolling restart: one host on the old version, one on the new), the rule says nothing of the
name: a front end keeps what it serves, and no worker retires a version of it. In-process,
"enough" is every worker of the pool: its load returns once each holds the version.

**When a rollout is given up** (``given_up``): only by an explicit event, never a timer.
A version that failed to load on a live worker (a bad file, a failed self-test, over the
memory budget, past the load deadline ``MB_WORKER_START_TIMEOUT``), such that it can no
longer be ready on enough workers; a newer target; or the operator's unload.

**What a worker does with a version it holds** (``fate``): it keeps the version its name
serves and its target (which may still become the one served), and drains the others: an
older version once its name has moved on, a version given up, every version of an unloaded
name, and a version newer than its target once the target is ready beside it (a rollback).
Draining a version is ``app.broker.versions``' job: no new request reaches it, those sent
finish, then it is unloaded.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from enum import Enum
from typing import Literal, Protocol, TypeVar

from app.errors import ModelNotFound
from app.lifecycle.states import Route, VersionState

UNLOADED: Literal["unloaded"] = "unloaded"
UNKNOWN = -1  # a name whose target cannot be read (gone from disk): what serves it stays
# What the admin route set for a name: a version number, or unloaded.
AdminPin = int | Literal["unloaded"]

# Loads at once on one host (the pool's workers, or a broker host's under a lock in Redis):
# a load shares the host's cores with the batches, so its other workers serve at full speed.
LOADERS_PER_HOST = 1
# A worker stops reading a drained version's streams only once its name has served another
# version this long (every front end, which looks once a second, has switched), and unloads
# it this much later if they are still empty (a read in flight then has landed).
SWITCH_GRACE_S = 3.0
RETIRE_S = 2.5


def chosen_version(
    name: str, on_disk: Collection[int], pin: int | None = None, admin: AdminPin | None = None
) -> int | None:
    """The version ``name`` should serve (its target): ``admin`` (a load by the admin
    route), else ``pin`` (``MB_MODEL_VERSIONS``), else the newest of ``on_disk``; None once
    the admin route unloaded it. ``ModelNotFound`` when that version is not on disk.

    >>> chosen_version("tagger", [1, 2, 3]), chosen_version("tagger", [1, 2, 3], pin=2)
    (3, 2)
    >>> chosen_version("tagger", [1, 2, 3], pin=2, admin=1)
    1
    >>> chosen_version("tagger", [1, 2, 3], admin="unloaded") is None
    True
    """
    if admin == UNLOADED:
        return None
    if not on_disk:
        raise ModelNotFound(f"no model named {name!r} in the repository")
    for wanted, who in ((admin, "the admin route loaded"), (pin, "MB_MODEL_VERSIONS pins")):
        if wanted is None:
            continue
        if wanted not in on_disk:
            listed = ", ".join(map(str, sorted(on_disk)))
            raise ModelNotFound(f"{who} {name}={wanted}, but it has versions {listed}")
        return int(wanted)
    return max(on_disk)


class HeldView(Protocol):
    """One version a worker holds, is loading or failed to load, as its heartbeat says."""

    @property
    def name(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def served_id(self) -> str: ...
    @property
    def state(self) -> VersionState: ...
    @property
    def step(self) -> str: ...
    @property
    def reason(self) -> str: ...


class WorkerView(Protocol):
    """One worker, as its heartbeat says (``app.broker.wire.WorkerInfo``)."""

    @property
    def name(self) -> str: ...
    @property
    def alive(self) -> bool: ...
    @property
    def draining(self) -> bool: ...
    @property
    def models(self) -> Sequence[HeldView]: ...
    @property
    def aimed(self) -> int:
        """The number of the last request to load or unload (a pin, a reload) it acted on:
        what it says of a version after that is this request's outcome."""


Serving = TypeVar("Serving", bound=WorkerView)


def _serving(workers: Sequence[Serving]) -> list[Serving]:
    return [w for w in workers if w.alive and not w.draining]


def _holding(workers: Sequence[WorkerView]) -> dict[str, set[str]]:
    """name -> the serving workers that hold (or are loading) a version of it."""
    holding: dict[str, set[str]] = {}
    for worker in _serving(workers):
        for model in worker.models:
            if model.state in (VersionState.LOADING, VersionState.READY):
                holding.setdefault(model.name, set()).add(worker.name)
    return holding


def needed(holders: int, min_workers: int | None) -> int:
    """On how many of ``holders`` workers a version must be ready to serve its name."""
    return holders if min_workers is None else min(holders, min_workers)


def routes(
    workers: Sequence[WorkerView],
    min_workers: int | None = None,
    sticky: Mapping[str, Route] | None = None,
) -> dict[str, Route]:
    """name -> the version it serves, by the rule above. A version may be held in several
    precisions (``MB_DTYPE=auto`` on hosts with and without bf16 units): it counts as ready
    on each worker holding any of them, and routes to the one ready on the most workers (the
    others' workers take none of its requests meanwhile: a pin must name the routed id).
    With ``sticky`` (a front end's current routes), a name the rule says
    nothing of keeps its route while that version is still ready on a live worker, else
    takes the version ready on the most workers (a front end must route somewhere); without
    it (a worker deciding what to retire), such a name is left out.

    Tested in ``tests/unit/test_rules.py``.
    """
    holding = _holding(workers)
    # name -> version -> served id -> the workers it is ready on
    ready: dict[str, dict[int, dict[str, set[str]]]] = {}
    for worker in _serving(workers):
        for model in worker.models:
            if model.state is VersionState.READY:
                variants = ready.setdefault(model.name, {}).setdefault(model.version, {})
                variants.setdefault(model.served_id, set()).add(worker.name)

    def route(version: int, variants: dict[str, set[str]]) -> Route:
        return Route(version, max(variants, key=lambda sid: (len(variants[sid]), sid)))

    def ready_on(variants: dict[str, set[str]]) -> int:
        return len(set().union(*variants.values()))

    chosen: dict[str, Route] = {}
    for name, versions in ready.items():
        least = needed(len(holding[name]), min_workers)
        enough = [version for version, variants in versions.items() if ready_on(variants) >= least]
        if enough:
            chosen[name] = route(max(enough), versions[max(enough)])
        elif sticky is not None:
            kept = sticky.get(name)
            if kept is None or kept.served_id not in versions.get(kept.version, {}):
                most = max(versions, key=lambda v: (ready_on(versions[v]), v))
                kept = route(most, versions[most])
            chosen[name] = kept
    return chosen


class Aiming(WorkerView, Protocol):
    """A worker as ``followed`` reads it: also the version it was last aimed at, by name."""

    @property
    def targets(self) -> Mapping[str, int]: ...


def followed(
    targets: Mapping[str, int | None],
    decided: Collection[str],
    workers: Sequence[Aiming],
    on_disk: Callable[[str], Collection[int]],
) -> dict[str, int | None]:
    """A worker's targets as its supervisor restarts it (after a crash) beside ``workers``:
    a name they serve whose target the newest on disk gives (no pin ``decided`` it) aims at
    the newest version of it they were aimed at (their heartbeats' ``targets``: a load still
    queued counts) or hold ready or are loading, among those ``on_disk`` here. A crash rolls
    out nothing nobody asked for (found by make chaos: a version published with no reload,
    every worker killed in turn, each restarted loaded it, and the fleet switched), and
    leaves a rollout in progress going. A name none of them aims at keeps its target, as
    does one it cannot read, or one whose versions they aim at are not on disk here.

    >>> from types import SimpleNamespace as V
    >>> ready, disk = VersionState.READY, lambda name: (1, 2, 3)
    >>> w = V(name="w1", alive=True, draining=False, targets={"m": 2},
    ...       models=[V(name="m", version=1, state=ready)])
    >>> followed({"m": 3, "n": 1}, (), [w], disk), followed({"m": 3}, ("m",), [w], disk)
    ({'m': 2, 'n': 1}, {'m': 3})
    """
    aimed: dict[str, set[int]] = {}
    for worker in _serving(workers):
        for model in worker.models:
            if model.state in (VersionState.LOADING, VersionState.READY):
                aimed.setdefault(model.name, set()).add(model.version)
        for name, version in worker.targets.items():
            aimed.setdefault(name, set()).add(version)
    chosen = dict(targets)
    for name, target in targets.items():
        if name in decided or target is None or target == UNKNOWN or name not in aimed:
            continue
        there = aimed[name] & set(on_disk(name))
        if there:
            chosen[name] = max(there)
    return chosen


def given_up(
    workers: Sequence[WorkerView], min_workers: int | None = None
) -> dict[tuple[str, int], str]:
    """(name, version) -> why, for each version that failed to load on a live worker and
    can no longer be ready on enough of them (those loading it or holding it ready are fewer
    than the rule needs): every worker then gives it up, and what served before serves on.
    A worker's own deadline ends a load that hangs (it fails with step ``timeout``)."""
    holding = _holding(workers)
    failed: dict[tuple[str, int], list[str]] = {}
    alive: dict[tuple[str, int], int] = {}  # loading or ready
    for worker in _serving(workers):
        for model in worker.models:
            key = (model.name, model.version)
            if model.state is VersionState.FAILED:
                failed.setdefault(key, []).append(f"{worker.name}: {model.step}: {model.reason}")
            elif model.state in (VersionState.LOADING, VersionState.READY):
                alive[key] = alive.get(key, 0) + 1
    return {
        key: "; ".join(reasons)
        for key, reasons in failed.items()
        if alive.get(key, 0) < max(1, needed(len(holding.get(key[0], ())), min_workers))
    }


class Fate(Enum):
    """What a worker does with a version it holds."""

    KEEP = "keep"
    DRAIN = "drain"


def fate(
    held: HeldView,
    *,
    route: Route | None,
    target: int | None,
    target_ready: bool,
    route_held: bool,
    gave_up: bool = False,
) -> Fate:
    """Whether a worker keeps ``held`` or drains it. ``route``: the version its name serves
    by ``routes`` (without ``sticky``), None if the rule says nothing; ``target``: the
    version this worker's repository chooses for the name (None: unloaded by the operator);
    ``target_ready``: this worker holds the target ready; ``route_held``: it holds the
    routed version ready (in any precision); ``gave_up``: ``given_up`` names ``held``.

    >>> from app.lifecycle.states import VersionLife
    >>> v2 = VersionLife("t", 2, "t@2", VersionState.READY)
    >>> fate(v2, route=Route(1, "t@1"), target=2, target_ready=True, route_held=True)
    <Fate.KEEP: 'keep'>
    >>> fate(v2, route=Route(3, "t@3"), target=3, target_ready=True, route_held=True)
    <Fate.DRAIN: 'drain'>
    """
    if gave_up or target is None:
        return Fate.DRAIN
    if held.version > target and target_ready:
        return Fate.DRAIN  # withdrawn: the repository went back (a rollback, or a pin)
    if route is not None and held.version == route.version:
        return Fate.KEEP  # the version its name serves (in whichever precision held here)
    if held.version == target:
        return Fate.KEEP  # it may still become the one served
    if route is None or not route_held:
        return Fate.KEEP  # the rule says nothing yet, or this is all this worker has of it
    return Fate.DRAIN


def why_drained(life: HeldView, route: Route | None, target: int | None, why: str | None) -> str:
    """Why ``life`` drains, for the index and the log."""
    if why is not None:
        return f"given up: {why}"
    if target is None:
        return "unloaded by the admin route"
    if life.version > target:
        return f"withdrawn: version {target} is chosen now"
    if route is not None:
        return f"its name serves version {route.version} now"
    return "no longer chosen"
