"""The lifecycle's steps for one model worker, written once: what it should hold (``aim``),
which load it starts next (``next_load``), a load that ended (``loaded``, ``failed``), which
versions it keeps or drains and when it unloads them (``settle``), and what it says of them
(``held``). Every worker runs its versions through a ``Keeper``: a pool's workers through
the pool (``app.workers.hosting``, one keeper per worker, in the HTTP process), a broker
worker through its own (``app.broker.worker.versions``). Start-up is a load like any other:
a worker starts with nothing and is aimed.

A keeper does no I/O and keeps no time of its own: its driver reads the repository for it
(``read``), runs its loads, reads and unloads what it says (``Effect``), and tells it the
time and what the other workers hold (``WorkerView``).

Versions are held by name and number (two names, or two numbers of one name, may be the
same export: it is loaded once, by served id, and unloaded once no version holds it).

- **Aim**: each name's target (``app.lifecycle.chosen_version``, read by the driver). An
  export held already serves under the target's number with no load (a rollback written as
  the next version: one form of rollback, the renumbering). A worker that starts beside
  others (``routes``: what they serve) loads what they serve first, so it serves at once
  mid-rollout, then the target (a broker worker restarted after a crash is aimed at
  what they were aimed at: ``app.lifecycle.followed``). A version that failed is not
  loaded again, unless the aim is ``explicit`` (SIGHUP, the admin route): a poll never
  retries.
- **Load**: one at a time, in order; never a version the other workers gave up on.
- **Settle**: ``app.lifecycle.fate`` for each version held; a version drained stops being
  read once its work is done (``empty``) and ``grace_s`` has passed since it began draining
  (every front end has moved on), and is unloaded ``retire_s`` later if still empty.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from app.lifecycle.rules import (
    UNKNOWN,
    Fate,
    WorkerView,
    fate,
    given_up,
    routes,
    why_drained,
)
from app.lifecycle.states import ModelSpec, Route, VersionLife, VersionState, files_of

# Reads ``name``'s version ``number`` from the repository as the worker loads it (verifying
# every file when ``verify``): its spec, in the precision its export is decided in where it
# is. Raises what the repository raises (ModelNotFound, ModelStoreError).
Reader = Callable[[str, int, bool], ModelSpec]


@dataclass(frozen=True)
class Effect:
    """What a keeper asks its driver to do with one export it holds: start reading its work
    (``read``: a broker worker's streams), stop (``unread``), or unload it (``unload``:
    give its memory back)."""

    kind: Literal["read", "unread", "unload"]
    served_id: str


def export_of(served_id: str) -> str:
    """The export a served id names, without its precision (``arch@12hex``)."""
    return served_id.split("+", 1)[0]


class Keeper:
    """The versions one worker holds, loads and drains (see the module's docstring).

    >>> keeper = Keeper("host:0")
    >>> spec = ModelSpec("tagger", 1, "/m/tagger/1", "tiny@1")
    >>> keeper.aim({"tagger": 1}, lambda name, number, verify: spec, explicit=True)
    >>> loading = keeper.next_load()
    >>> keeper.begin(loading); loading.served_id
    'tiny@1'
    >>> keeper.loaded(loading, spec.decided("bfloat16", "tiny@1+bf16"))
    [Effect(kind='read', served_id='tiny@1+bf16')]
    >>> [(h.name, h.version, h.served_id, h.state.value) for h in keeper.held()]
    [('tagger', 1, 'tiny@1+bf16', 'ready')]
    """

    def __init__(
        self,
        name: str,
        *,
        min_workers: int | None = None,
        grace_s: float = 0.0,
        retire_s: float = 0.0,
        on_error: Callable[[str], None] = lambda message: None,
        on_failed: Callable[[ModelSpec, str], None] = lambda spec, step: None,
    ) -> None:
        self.name = name
        self.min_workers = min_workers
        self.grace_s = grace_s
        self.retire_s = retire_s
        self._on_error = on_error
        # A version that failed with no load to report it (a copy of a held export that does
        # not verify): its driver counts it with the loads that failed.
        self._on_failed = on_failed
        self.lives: dict[tuple[str, int], VersionLife] = {}  # held or loading, by (name, number)
        self.specs: dict[tuple[str, int], ModelSpec] = {}  # each one's spec, as held
        self.failed: dict[tuple[str, int], VersionLife] = {}  # FAILED, until no longer aimed at
        # Each failure's store and what its folder held then (tried again once that changes).
        self._failed_files: dict[tuple[str, int], tuple[str, tuple[object, ...]]] = {}
        self.targets: dict[str, int | None] = {}  # name -> its target (None: unloaded)
        self.queue: list[ModelSpec] = []
        self.loading: ModelSpec | None = None
        self.aimed = 0  # the number of the request it was last aimed by (a pin, a reload)
        # Asked again (an explicit aim), not tried since: tried whatever the other workers
        # said of them before (a SIGHUP of one host does not move the fleet's request number).
        self._asked_again: set[tuple[str, int]] = set()
        self._stopped: dict[str, float] = {}  # served id -> when its reads stopped (draining)
        self._read: Reader = _unread

    # -- what it holds -------------------------------------------------------------------------

    def held(self) -> list[VersionLife]:
        """Every version held or loading, then every one that failed: what its heartbeat
        (or its pool's view) says, by name and number."""
        ordered = sorted(self.lives.values(), key=lambda life: (life.name, life.version))
        return ordered + sorted(self.failed.values(), key=lambda life: (life.name, life.version))

    def holds(self, served_id: str) -> bool:
        """Whether it holds ``served_id`` (loaded, under some name)."""
        return any(life.served_id == served_id for life in self._loaded())

    def holders(self, served_id: str) -> list[VersionLife]:
        return [life for life in self._loaded() if life.served_id == served_id]

    def spec(self, served_id: str) -> ModelSpec | None:
        """The spec of an export it holds (the first version that holds it)."""
        for key, life in self.lives.items():
            if life.served_id == served_id and life.state is not VersionState.LOADING:
                return self.specs[key]
        return None

    def _loaded(self) -> list[VersionLife]:
        return [life for life in self.lives.values() if life.state is not VersionState.LOADING]

    def _export_held(self, served_id: str) -> tuple[str, int] | None:
        """The version holding (or loading) ``served_id``'s export, in whatever precision."""
        export = export_of(served_id)
        for key, life in self.lives.items():
            if export_of(life.served_id) == export:
                return key
        return None

    # -- aiming --------------------------------------------------------------------------------

    def aim(
        self,
        targets: Mapping[str, int | None],
        read: Reader,
        *,
        explicit: bool,
        asked: int = 0,
        serving: Mapping[str, Route] | None = None,
        gave_up: Iterable[tuple[str, int]] = (),
    ) -> None:
        """Take each name's target (None: unloaded; ``UNKNOWN``: cannot be read) and queue
        the loads of what it lacks (see the module's docstring). ``asked``: the number of the
        request (a pin, a reload) this aim acts on: what other workers say before acting on
        it (a failure, say) is the last attempt's. ``serving``: the routes the other workers
        serve now, for a worker that starts beside them; ``gave_up``: the versions they gave
        up."""
        gave_up = set(gave_up)
        self._read = read
        self.aimed = max(self.aimed, asked)
        self.targets = dict(targets)
        if explicit:  # tried again: SIGHUP or the admin route
            self.failed = {}
        # Failures of versions no longer aimed at are moot (a newer version, a rollback), and
        # so are those whose files changed since (a copy finished after it was read).
        self.failed = {
            k: v
            for k, v in self.failed.items()
            if self.targets.get(k[0]) == k[1] and not self._files_changed(k)
        }
        self._failed_files = {k: v for k, v in self._failed_files.items() if k in self.failed}
        queue: list[ModelSpec] = []
        for name, target in targets.items():
            if target is None or target == UNKNOWN:
                continue
            numbers = [target]
            route = (serving or {}).get(name)
            if route is not None and route.version != target and (name, target) not in self.lives:
                # Beside workers that serve another version: that one first (so it serves at
                # once), then the target, unless they gave it up.
                numbers = [route.version] if (name, target) in gave_up else [route.version, target]
            for number in numbers:
                if (name, number) in self.failed or (name, number) in self.lives:
                    continue
                try:
                    queue.append(read(name, number, False))
                except Exception as exc:  # ModelNotFound, ModelStoreError: reported
                    self._on_error(f"{name} version {number}: {getattr(exc, 'message', exc)}")
                    if number == target:
                        self.targets[name] = UNKNOWN
        self.queue = queue
        queued = {(spec.name, spec.version) for spec in queue}
        self._asked_again = queued if explicit else self._asked_again & queued
        self._place_held()

    def _place_held(self) -> None:
        """Versions queued whose export is held already: held under their number too, with
        no load."""
        for spec in list(self.queue):
            holder = self._export_held(spec.served_id)
            if holder is not None and self.lives[holder].state is not VersionState.LOADING:
                self.queue.remove(spec)
                self._adopt(spec, holder)

    def _read_now(self, spec: ModelSpec) -> None:
        self._read(spec.name, spec.version, True)

    def _adopt(self, spec: ModelSpec, holder: tuple[str, int]) -> None:
        """``spec``'s export is held as ``holder``: it is held under ``spec``'s name and
        number too (a rollback written as the next version, or one export under two names),
        once its folder verifies. A version of the name no longer wanted then drains."""
        try:
            self._read_now(spec)
        except Exception as exc:  # a copy that does not verify: a failure like any other
            reason = str(getattr(exc, "message", exc))
            self._fail_new(spec, "verify", reason)
            self._on_error(f"{spec.name} version {spec.version} failed: verify: {reason}")
            self._on_failed(spec, "verify")
            return
        life = self.lives[holder]
        key = (spec.name, spec.version)
        adopted = VersionLife(spec.name, spec.version, life.served_id)
        adopted.move(VersionState.LOADING)
        adopted.move(VersionState.READY)
        self.lives[key] = adopted
        held = self.specs[holder]
        self.specs[key] = ModelSpec(
            spec.name, spec.version, spec.store, held.served_id, held.image_shape, held.dtype
        )

    # -- loading -------------------------------------------------------------------------------

    def _given_up(self, workers: Sequence[WorkerView]) -> dict[tuple[str, int], str]:
        """The versions given up (``app.lifecycle.given_up``) by what the workers said since
        they acted on the request this one last acted on."""
        return given_up([w for w in workers if w.aimed >= self.aimed], self.min_workers)

    def next_load(
        self, workers: Sequence[WorkerView] = (), also: Iterable[tuple[str, int]] = ()
    ) -> ModelSpec | None:
        """The load to start next, if any: not a version the workers gave up (it would only
        be given up again; the next explicit aim tries again, once, whatever the others said
        before), nor one of ``also`` (given up besides: a load that killed a worker)."""
        if self.loading is not None:
            return None
        gave_up = {*(self._given_up(workers).keys() - self._asked_again), *also}
        self._place_held()
        while self.queue:
            spec = self.queue[0]
            key = (spec.name, spec.version)
            if key in self.lives or key in self.failed or key in gave_up:
                self.queue.pop(0)
                continue
            if self._export_held(spec.served_id) is not None:
                return None  # loading under another name or number: held once it is
            return spec
        return None

    def begin(self, spec: ModelSpec) -> None:
        """The load of ``spec`` (``next_load``'s) starts."""
        if spec in self.queue:
            self.queue.remove(spec)
        key = (spec.name, spec.version)
        self._asked_again.discard(key)
        life = VersionLife(spec.name, spec.version, spec.served_id)
        life.move(VersionState.LOADING)
        self.lives[key], self.specs[key], self.loading = life, spec, spec

    def loaded(self, requested: ModelSpec, held: ModelSpec) -> list[Effect]:
        """The load of ``requested`` ended well: held as ``held`` (in the precision chosen,
        under its id); its work is read from now on."""
        key = (requested.name, requested.version)
        life = self.lives[key]
        life.served_id = held.served_id
        life.move(VersionState.READY)
        self.specs[key] = held
        self.loading = None
        return [Effect("read", held.served_id)]

    def failed_load(self, requested: ModelSpec, step: str, reason: str) -> None:
        """The load of ``requested`` failed at ``step`` (or passed its deadline: ``timeout``):
        FAILED here, with why; what served before serves on."""
        self.lives.pop((requested.name, requested.version), None)
        self.specs.pop((requested.name, requested.version), None)
        if self.loading == requested:
            self.loading = None
        self._fail_new(requested, step, reason)

    def dropped(self, requested: ModelSpec, instead: ModelSpec | None = None) -> None:
        """The load of ``requested`` was dropped, to load ``instead`` (the same version in
        the precision its fleet serves it in) next."""
        self.lives.pop((requested.name, requested.version), None)
        self.specs.pop((requested.name, requested.version), None)
        if self.loading == requested:
            self.loading = None
        if instead is not None:
            self.queue.insert(0, instead)

    def fail(self, spec: ModelSpec, step: str, reason: str) -> None:
        """A version that failed elsewhere (it killed another worker of the host as it
        loaded): FAILED here too, unless held; not loaded until an explicit aim."""
        key = (spec.name, spec.version)
        if key not in self.lives:
            self.queue = [s for s in self.queue if (s.name, s.version) != key]
            self._fail_new(spec, step, reason)

    def _fail_new(self, spec: ModelSpec, step: str, reason: str) -> None:
        life = VersionLife(spec.name, spec.version, spec.served_id)
        life.move(VersionState.LOADING)
        life.move(VersionState.FAILED, step, reason)
        self.failed[(spec.name, spec.version)] = life
        self._failed_files[(spec.name, spec.version)] = (spec.store, files_of(spec.store))

    def _files_changed(self, key: tuple[str, int]) -> bool:
        store, then = self._failed_files.get(key, ("", ()))
        return bool(store) and files_of(store) != then

    # -- keeping and draining ------------------------------------------------------------------

    def settle(
        self,
        workers: Sequence[WorkerView],
        now: float,
        empty: Callable[[str], bool],
        gave_up: Mapping[tuple[str, int], str] | None = None,
    ) -> list[Effect]:
        """Keep or drain each version held, by the lifecycle's rules, given every live
        worker (this one among them); stop reading and unload what drained once ``empty``
        says its work is done. ``gave_up``: versions given up besides those the rules give
        up (a load that killed a worker). Returns what the driver must do."""
        routed = routes(workers, self.min_workers)
        gave = {**self._given_up(workers), **(gave_up or {})}
        ready = {key for key, life in self.lives.items() if life.state is VersionState.READY}
        effects: list[Effect] = []
        for key, life in list(self.lives.items()):
            if life.state is VersionState.LOADING:
                continue
            name = life.name
            target = self.targets.get(name, UNKNOWN)
            if target == UNKNOWN:
                target = life.version  # its name's target cannot be read: keep it
            route = routed.get(name)
            why = gave.get(key)
            decided = fate(
                life,
                route=route,
                target=target,
                target_ready=(name, target) in ready,
                route_held=route is not None and (name, route.version) in ready,
                gave_up=why is not None,
            )
            if decided is Fate.KEEP:
                if life.state is VersionState.DRAINING:
                    life.move(VersionState.READY)
                    if self._stopped.pop(life.served_id, None) is not None:
                        effects.append(Effect("read", life.served_id))
                continue
            if life.state is VersionState.READY:
                life.move(VersionState.DRAINING, reason=why_drained(life, route, target, why))
        for served_id in sorted({life.served_id for life in self._draining()}):
            effects += self._drain(served_id, now, empty)
        return effects

    def _draining(self) -> list[VersionLife]:
        return [life for life in self.lives.values() if life.state is VersionState.DRAINING]

    def _drain(self, served_id: str, now: float, empty: Callable[[str], bool]) -> list[Effect]:
        """Stop reading a drained export once its work is done and ``grace_s`` has passed;
        unload it ``retire_s`` later if still done (new work puts it back in the reads). A
        version whose export another version still holds just goes (and that export is read
        again if it had stopped: a rollback written as the next version while this one
        drained)."""
        holders = [(k, life) for k, life in self.lives.items() if life.served_id == served_id]
        if any(life.state is not VersionState.DRAINING for _, life in holders):
            for key, life in holders:
                if life.state is VersionState.DRAINING:
                    self._gone(key)
            was_stopped = self._stopped.pop(served_id, None) is not None
            return [Effect("read", served_id)] if was_stopped else []
        stopped = self._stopped.get(served_id)
        if stopped is None:
            settled = min(life.age_s(now) for _, life in holders) >= self.grace_s
            if settled and empty(served_id):
                self._stopped[served_id] = now
                return [Effect("unread", served_id)]
            return []
        if now - stopped < self.retire_s:
            return []
        del self._stopped[served_id]
        if not empty(served_id):
            return [Effect("read", served_id)]
        for key, _ in holders:
            self._gone(key)
        return [Effect("unload", served_id)]

    def _gone(self, key: tuple[str, int]) -> None:
        life = self.lives.pop(key)
        self.specs.pop(key, None)
        life.move(VersionState.UNLOADED)

    def drained(
        self,
        others: Sequence[WorkerView],
        since: float,
        now: float,
        empty: Callable[[str], bool],
    ) -> bool:
        """Told to stop (at ``since``): whether every version held can be left to the other
        live workers (``others``, not stopping). One can, once another holds it; or once no
        other holds a version of its name (nothing to hand over to); or once the rule
        serves its name with another version, ``grace_s`` has passed and its work is done."""
        chosen = routes(others, self.min_workers)
        live = (VersionState.LOADING, VersionState.READY)
        for life in self._loaded():
            ready = VersionState.READY
            if any(
                m.served_id == life.served_id and m.state is ready for w in others for m in w.models
            ):
                continue
            if not any(m.name == life.name and m.state in live for w in others for m in w.models):
                continue
            route = chosen.get(life.name)
            moved = route is not None and route.served_id != life.served_id
            if not (moved and now - since >= self.grace_s and empty(life.served_id)):
                return False
        return True


def _unread(name: str, number: int, verify: bool) -> ModelSpec:
    raise RuntimeError("a keeper reads the repository only once aimed")
