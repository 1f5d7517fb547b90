"""The model versions a pool's workers hold: one ``app.lifecycle.Keeper`` per worker (the
same steps a broker worker runs for itself), driven from this process, which the workers
obey (load, unload). ``PoolHost`` is the pool's ``VersionControl``.

- **Start-up is a load**: workers start with nothing; ``start`` loads each name's target on
  every worker at once (nothing serves yet), and fails saying why if a name loads nowhere.
- **Later loads** (the admin route, SIGHUP, the poll) run on one worker at a time
  (``LOADERS_PER_HOST``), each beside that worker's batches; a worker restarted after dying
  starts as one beside the others: what the pool serves first, then the target. A load that
  killed its worker is given up on every worker until an explicit retry.
- **The precision** under ``MB_DTYPE=auto`` is chosen once per export for the pool
  (``app.workers.choices.PrecisionChoice``): one id per export, the one the workers hold.
- **Which version serves** is ``app.lifecycle.routes`` over the keepers, as in broker mode;
  a drained version is unloaded from a worker once no request here uses it (``in_use``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from app.background import Background
from app.batching import ClusterView
from app.errors import ModelLoadFailed, ServerError, WorkerDied, WorkerStartError
from app.lifecycle import (
    LOADERS_PER_HOST,
    UNKNOWN,
    AdminPin,
    ModelSpec,
    Route,
    given_up,
    routes,
)
from app.lifecycle.keeper import Keeper, export_of
from app.repository import scrub
from app.workers.choices import HostChoices, PoolRecord, PrecisionChoice
from app.workers.hands import Hands, LoadObserver, PoolWorker, PoolWorkerView

if TYPE_CHECKING:
    from app.repository import Repository

log = logging.getLogger("app.workers.pool")

TICK_S = 0.25  # how often the host looks again without being woken (drains finishing)


class PoolHost:
    """The versions of a pool's workers (see the module's docstring).

    >>> # host = PoolHost(pool, choices=HostChoices(state_dir))
    >>> # host.attach(repository, "auto", on_view=models.follow, in_use=registry.in_use)
    >>> # await host.start()                   # every worker loads its names' targets
    >>> # asked = await host.pin("tagger", 3)  # one worker at a time; then the name moves
    """

    def __init__(
        self,
        hands: Hands,
        *,
        choices: HostChoices | None = None,
        min_workers: int | None = None,
        on_load: LoadObserver | None = None,
    ) -> None:
        self.hands = hands
        self.precision = PrecisionChoice(PoolRecord(), choices or HostChoices(None))
        self.min_workers = min_workers
        self._on_load = on_load
        self.repository: Repository | None = None
        self.dtype = "auto"
        self._on_view: Callable[[ClusterView], None] = lambda view: None
        self._in_use: Callable[[str], bool] = lambda served_id: False
        self.pins: dict[str, AdminPin] = {}
        self.seq = 0  # numbers every pin and reload; a keeper aimed since has acted on it
        self.keepers: dict[int, Keeper] = {}  # by worker slot
        self._workers: dict[int, PoolWorker] = {}  # slot -> the worker its keeper is for
        self._routes: dict[str, Route] = {}
        # Each name's last route, kept while every worker that held it restarts (the routes
        # then say nothing of it): what a restarted worker loads first. Dropped once the
        # name is aimed at nothing (unloaded, or gone from the repository).
        self._served: dict[str, Route] = {}
        # The targets of the last aim (start-up, a pin, a reload): a restarted worker's too,
        # not the repository read afresh (a version published since waits for its reload).
        self._aimed: dict[str, int | None] | None = None
        self._loads: dict[int, asyncio.Task[None]] = {}  # slot -> its running load
        self._unloads = Background()
        self._wake = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None
        self._starting = False
        self._retrying = False  # a worker died in a load that may work once restarted
        # Loads that killed their worker: never tried again by its restarted self, nor by a
        # poll (a model that crashes its worker would crash it on every restart), until an
        # explicit retry (SIGHUP, the admin route).
        self._crashed: dict[tuple[str, int], tuple[ModelSpec, str]] = {}
        self._view = ClusterView()

    # -- VersionControl ----------------------------------------------------------------------

    def attach(
        self,
        repository: Repository,
        dtype: str,
        on_view: Callable[[ClusterView], None],
        in_use: Callable[[str], bool],
    ) -> None:
        self.repository, self.dtype = repository, dtype
        self._on_view, self._in_use = on_view, in_use

    async def pin(self, name: str, pin: AdminPin | None) -> int:
        if pin is None:
            self.pins.pop(name, None)
        else:
            self.pins[name] = pin
        return self._aim_all(explicit=True)

    async def reload(self, *, explicit: bool) -> int:
        return self._aim_all(explicit=explicit)

    @property
    def view(self) -> ClusterView:
        return self._view

    async def refresh(self) -> None:
        """The view is always current here: wait a moment for it to change."""
        await asyncio.sleep(0.02)

    # -- what it holds -----------------------------------------------------------------------

    def spec_of(self, served_id: str) -> ModelSpec | None:
        """The spec of an export some worker holds."""
        for keeper in self.keepers.values():
            spec = keeper.spec(served_id)
            if spec is not None:
                return spec
        return None

    def held_ids(self) -> set[str]:
        """The exports some worker holds (or loads)."""
        return {life.served_id for k in self.keepers.values() for life in k.lives.values()}

    # -- reading the repository --------------------------------------------------------------

    def targets(self) -> dict[str, int | None]:
        """Each name's target (``app.repository.Repository.targets``)."""
        if self.repository is None:  # not attached: it holds nothing
            return {}
        return self.repository.targets(self.pins, log.error)

    def read(self, name: str, number: int, verify: bool) -> ModelSpec:
        """``name``'s ``number`` as a worker loads it: in the precision this host serves its
        export in, once decided (``decided``)."""
        assert self.repository is not None
        return self.decided(self.repository.spec(name, number, self.dtype, verify=verify))

    def decided(self, spec: ModelSpec) -> ModelSpec:
        """``spec`` in the precision this host serves its export in, once decided
        (``app.workers.choices.PrecisionChoice``)."""
        return self.precision.decided(spec)

    # -- aiming, loading, draining -----------------------------------------------------------

    def _aim_all(self, *, explicit: bool) -> int:
        self.seq += 1
        if explicit:
            self._crashed.clear()
        self._aimed = targets = self.targets()
        self._served = {n: r for n, r in self._served.items() if targets.get(n) is not None}
        for keeper in self.keepers.values():
            keeper.aim(targets, self.read, explicit=explicit, asked=self.seq)
        self._wake.set()
        return self.seq

    def _sync(self) -> None:
        """A keeper for each live worker: a new one (started, or restarted after dying) is
        aimed as a worker starting beside the others."""
        workers = {w.index: w for w in self.hands.host_workers() if w.alive and w.ready}
        aimed = self._aimed if self._aimed is not None else self.targets()
        for slot in list(self.keepers):
            if slot in self._loads:
                continue  # it died loading: how that load ended decides first (a crash?)
            if self._workers.get(slot) is not workers.get(slot):
                del self.keepers[slot], self._workers[slot]
        for slot, worker in workers.items():
            if slot in self.keepers:
                continue
            others = self._views()
            keeper = Keeper(f"worker {slot}", min_workers=self.min_workers, on_error=log.error,
                            on_failed=self._failed_unloaded)  # fmt: skip
            # What the pool serves now (what requests are admitted for), not what the others
            # alone would make of it: one of them may hold a version that never switched;
            # when no worker held it any more, what it served last (not the newest on disk:
            # only a reload or a pin rolls a version out).
            serving = dict(self._served) or (routes(others, self.min_workers) if others else {})
            keeper.aim(
                aimed, self.read, explicit=False, asked=self.seq, serving=serving,
                gave_up=given_up(others, self.min_workers),
            )  # fmt: skip
            for spec, reason in self._crashed.values():
                keeper.fail(spec, "worker crash", reason)
            self.keepers[slot], self._workers[slot] = keeper, worker

    def _views(self) -> list[PoolWorkerView]:
        return [
            PoolWorkerView(
                keeper.name,
                # A worker that died loading counts until its load's end says why it died.
                alive=self._workers[slot].alive or slot in self._loads,
                models=tuple(keeper.held()),
                aimed=keeper.aimed,
            )
            for slot, keeper in sorted(self.keepers.items())
        ]

    def _start_loads(self) -> None:
        views = self._views()
        deciding = {export_of(k.loading.served_id) for k in self.keepers.values() if k.loading}
        for slot, keeper in sorted(self.keepers.items()):
            if slot in self._loads:
                continue
            if not self._starting and len(self._loads) >= LOADERS_PER_HOST:
                return  # a load shares the host's cores: the other workers serve meanwhile
            spec = keeper.next_load(views, self._crashed)
            if spec is None:
                continue
            spec = self.decided(spec)
            if spec.dtype == "auto" and export_of(spec.served_id) in deciding:
                continue  # another worker chooses its precision now: load it in that one
            if spec.dtype == "auto":
                deciding.add(export_of(spec.served_id))
            keeper.begin(spec)
            self._loads[slot] = asyncio.get_running_loop().create_task(
                self._load(slot, keeper, spec), name=f"load-{slot}-{spec.name}-{spec.version}"
            )

    async def _load(self, slot: int, keeper: Keeper, spec: ModelSpec) -> None:
        started = time.monotonic()
        worker = self._workers[slot]
        failed: str | None = None
        try:
            report = await self.hands.load_on(worker, spec)
        except (ModelLoadFailed, WorkerDied) as exc:
            failed = exc.step if isinstance(exc, ModelLoadFailed) else "worker crash"
            self._retrying = self._retrying or failed == "runtime crash"
            reason = self._scrub(exc.message)
            if failed == "worker crash":  # given up on every worker of the host
                self._crashed[(spec.name, spec.version)] = (spec, reason)
                for other in self.keepers.values():
                    other.fail(spec, failed, reason)
            keeper.failed_load(spec, failed, reason)
            log.error("loading %s version %d on worker %d failed: %s: %s",
                      spec.name, spec.version, slot, failed, reason)  # fmt: skip
        except ServerError as exc:  # the memory budget (507), say
            failed = getattr(exc, "step", "load")
            keeper.failed_load(spec, failed, self._scrub(exc.message))
        except Exception as exc:  # a bug must fail the load, not stop the lifecycle
            log.exception("loading %s version %d on worker %d failed", spec.name, spec.version,
                          slot)  # fmt: skip
            failed = "load"
            keeper.failed_load(spec, failed, f"{type(exc).__name__}: {exc}")
        else:
            held = spec.decided(report.dtype, report.served_id)
            self.precision.record(spec, held)  # the first to choose chose for the pool
            keeper.loaded(spec, held)
        finally:
            self._loads.pop(slot, None)
            self._wake.set()
        if self._on_load is not None:
            self._on_load(spec.name, spec.version, time.monotonic() - started, failed)

    def _failed_unloaded(self, spec: ModelSpec, step: str) -> None:
        """A version that failed without a load (a copy of a held export that does not
        verify): counted with the loads that failed."""
        if self._on_load is not None:
            self._on_load(spec.name, spec.version, 0.0, step)

    def _settle(self) -> None:
        now = time.monotonic()
        crashed = {key: reason for key, (_, reason) in self._crashed.items()}
        views = self._views()
        for slot, keeper in list(self.keepers.items()):
            worker = self._workers[slot]
            empty = lambda sid: not self._in_use(sid)  # noqa: E731
            for effect in keeper.settle(views, now, empty, crashed):
                if effect.kind == "unload":
                    self._unloads.start(self._unload(worker, effect.served_id))
        views = self._views()  # as the keepers left them: a version given up drains first
        self._routes = routes(views, self.min_workers, sticky=self._routes)
        self._served.update(self._routes)
        self._view = ClusterView(tuple(views), dict(self._routes), dict(self.pins))

    async def _unload(self, worker: PoolWorker, served_id: str) -> None:
        with contextlib.suppress(ServerError):  # a worker that dies restarts without it
            await self.hands.unload_on(worker, served_id)
        self._wake.set()

    def turn(self) -> None:
        """One round: keepers for the live workers, the next loads, each version kept or
        drained, and the new view told."""
        self._sync()
        self._start_loads()
        self._settle()
        self._on_view(self._view)

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TICK_S):
                    await self._wake.wait()
            self._wake.clear()
            try:
                self.turn()
            except Exception:  # a bug must not stop the lifecycle: log it, go on
                log.exception("the model host's round failed")

    def wake(self) -> None:
        """Look again now (a worker died or came back, a request drained)."""
        self._wake.set()

    # -- starting and stopping ---------------------------------------------------------------

    @property
    def starting(self) -> bool:
        """Loading the first models (``start``): every worker at once."""
        return self._starting

    async def start(self, timeout_s: float) -> None:
        """Load every name's target on every worker (start-up is a load like any other),
        then run; ``WorkerStartError`` saying why if a name loads nowhere. A worker that
        died loading is waited for while it restarts to load again (a runtime that crashed
        under ``MB_RUNTIME=auto`` is left out then: ``Hands.load_on``)."""
        self._starting = True
        self._aimed = self.targets()
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    self._sync()
                    self._start_loads()
                    if self._loads:
                        await asyncio.wait(list(self._loads.values()))
                    elif self._restarting():
                        await asyncio.sleep(0.05)
                    else:
                        break
        except TimeoutError:
            raise WorkerStartError(
                f"the models did not load within MB_WORKER_START_TIMEOUT={timeout_s:g} s"
            ) from None
        finally:
            self._starting = False
        self._settle()
        self._check_started()
        self._on_view(self._view)
        self._driver = asyncio.get_running_loop().create_task(self._run(), name="model-host")

    def _restarting(self) -> bool:
        """A worker restarts after it crashed in a load that may work on its next start."""
        if not self._retrying:
            return False
        workers = self.hands.host_workers()
        return any(not (w.alive and w.ready) for w in workers)

    def _check_started(self) -> None:
        targets = {n for n, t in self.targets().items() if t is not None and t != UNKNOWN}
        served = set(self._routes)
        for (name, number), (_, reason) in sorted(self._crashed.items()):
            if name in targets - served:
                raise WorkerStartError(
                    f"a worker exited during start-up, loading {name} version {number}: {reason}"
                )
        for name in sorted(targets - served):
            for slot, keeper in sorted(self.keepers.items()):
                failure = next((f for f in keeper.failed.values() if f.name == name), None)
                if failure is None:
                    continue
                worker = self._workers[slot]
                if failure.step == "worker crash":
                    raise WorkerStartError(
                        f"worker {slot} on {worker.device} exited during start-up, loading "
                        f"{failure.name} version {failure.version}: {failure.reason}"
                    )
                raise WorkerStartError(
                    f"worker {slot} on {worker.device} failed to start: {failure.name} "
                    f"version {failure.version}: {failure.step}: {failure.reason}"
                )
        if targets and not self.keepers:
            raise WorkerStartError("no model worker is running to load the models")

    async def aclose(self) -> None:
        tasks = [t for t in (self._driver, *self._loads.values()) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, self._unloads.cancel(), return_exceptions=True)
        self._driver = None

    def _scrub(self, message: str) -> str:
        return scrub(self.repository, message) if self.repository is not None else message
