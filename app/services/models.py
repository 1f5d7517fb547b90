"""The model versions a process that admits requests serves, in either mode: ``Models``
follows its workers (``app.batching.VersionControl``: the pool's, or the broker's) and asks
them for versions. Its workers load, hold and drain versions themselves
(``app.lifecycle.Keeper``: each worker's steps, written once); this side only

- **follows** (``follow``, at each new view of the workers): each name switches to the
  version its route names (``app.lifecycle.routes``: ready where it must be), under the id
  the workers hold it by (its precision included), in one assignment; the version it moved
  from drains here (requests admitted for it finish) while the workers drain it there; a
  name the admin route unloaded stops serving;
- **asks** (the admin routes, SIGHUP, the poll): ``load`` pins the version for every worker,
  then answers once the name serves it, or with why the workers gave it up (only a failure
  they reported after this request: a retried load is tried again, never answered with the
  last failure); ``unload`` pins the name unloaded and answers once no worker holds it.

Which version a name should serve is ``app.lifecycle.chosen_version``: a version the admin
route loaded stays chosen (a reload or a poll does not undo it) until the admin route loads
another, or loads the name without a version (its pin, else its newest, again). A load of a
name while another load of it runs waits for that one, then runs (one admin call at a
time). ``replace=True`` unloads what serves first (its memory back before the new version
loads), and the name answers 503 until the new one serves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from app.background import Background
from app.batching import ClusterView, VersionControl, WorkerStatus
from app.errors import (
    DeadlineExceeded,
    InvalidRequest,
    ModelLoadFailed,
    ModelMemoryBudget,
    ModelNotFound,
    ModelStoreError,
    NotReady,
)
from app.lifecycle import UNLOADED, Route, VersionState, WorkerView, given_up
from app.manifest import Manifest, split_served_id
from app.repository import Repository, VersionOnDisk, check_name, scrub
from app.services.index import index_rows
from app.services.predictor import Predictor
from app.services.registry import ModelRegistry, ModelVersion

log = logging.getLogger("app.models")

# Makes the Predictor of a version: its manifest, its class names and its served id.
PredictorFactory = Callable[[Manifest, list[str], str], Predictor]
LOOK_S = 0.2  # how often an admin call waiting for the workers looks at them
# An admin call waits for the workers' own load deadline, and this much more (their next
# heartbeat, and the next look).
MARGIN_S = 10.0


class Drains:
    """Versions that stopped serving here, each waiting for its last request (at most
    ``timeout_s``) before the registry forgets it: the workers unload its models once no
    request here uses it (``ModelRegistry.in_use``)."""

    def __init__(self, registry: ModelRegistry, timeout_s: float) -> None:
        self.registry = registry
        self.timeout_s = timeout_s
        self._tasks = Background()

    def later(self, version: ModelVersion | None) -> None:
        """Forget ``version`` once drained, in the background."""
        if version is None:
            return
        self._tasks.start(self._finish(version, version.drains))

    async def _finish(self, version: ModelVersion, drain: int) -> None:
        """``drain``: which of its drains this is (a rollback may serve it again, and a
        later drain waits on its own)."""
        try:
            await asyncio.wait_for(version.drained.wait(), self.timeout_s)
            late = False
        except TimeoutError:
            late = True
        if version.state is not VersionState.DRAINING or version.drains != drain:
            return  # serving again (a rollback), or draining anew: that drain's wait
        if late:
            log.warning(
                "%s still had %d request(s) after %.0f s of draining; letting it go anyway",
                version.label,
                version.in_flight,
                self.timeout_s,
            )
        self.registry.gone(version)

    async def aclose(self) -> None:
        await self._tasks.cancel()


class Models:
    """The versions this process serves, as its workers hold them.

    >>> # models = Models(registry, repository, transport.models, make_predictor,
    >>> #                 dtype="auto", drain_timeout_s=35, load_timeout_s=300)
    >>> # models.follow(view)                       # at each new view of the workers
    >>> # version = await models.load("tagger", 3)  # answers once it serves
    >>> # await models.unload("tagger")             # once no worker holds it
    """

    def __init__(
        self,
        registry: ModelRegistry,
        repository: Repository,
        control: VersionControl,
        make_predictor: PredictorFactory,
        *,
        dtype: str,
        drain_timeout_s: float,
        load_timeout_s: float,
        min_workers: int | None = None,
        in_place: bool = True,
    ) -> None:
        self.registry = registry
        # A load may replace what serves (in-process); a broker front end's pins are the
        # whole fleet's: an unload there would leave every front end without the name.
        self._in_place = in_place
        self.repository = repository
        self.control = control
        self._make_predictor = make_predictor
        self._dtype = dtype
        self._load_timeout_s = load_timeout_s
        self._min_workers = min_workers
        self._lock = asyncio.Lock()  # one admin call at a time
        self._drains = Drains(registry, drain_timeout_s)
        self._unreadable: dict[tuple[str, str], str] = {}  # logged once each
        self._coming: set[str] = set()  # names unloaded by a replace: back soon (503)
        self._stopping = False  # the server stops: admin calls waiting answer 503 now

    def read(self, name: str, version: int) -> VersionOnDisk:
        """``name``'s ``version`` as this process needs it: its served id, input size and
        class names (only the class file's sha256 is checked here: the workers verify the
        weights they load)."""
        return self.repository.read(name, version, self._dtype, roles=("classes",))

    # -- following the workers ---------------------------------------------------------------

    def follow(self, view: ClusterView) -> None:
        """Switch each name to the version its route names; a name the admin route
        unloaded stops serving. The version a name moved from drains."""
        for name, pin in view.pins.items():
            if pin == UNLOADED and self.registry.serving(name) is not None:
                self._drains.later(self.registry.retire(name, coming_back=name in self._coming))
                log.info("%s is unloaded", name)
        names = set(self.repository.names())
        for name, route in view.routes.items():
            if view.pins.get(name) == UNLOADED:
                continue
            if name not in names:  # workers serving a model this process does not have
                self._log_once(name, route.served_id, f"{name!r} is not in its repository")
                continue
            self._switch(name, route)

    def _switch(self, name: str, route: Route) -> None:
        current = self.registry.serving(name)
        if current is not None and current.served_id == route.served_id:
            self.registry.renumber(current, route.version)  # the same export, published again
            return
        held = self.registry.of_export(name, route.served_id)
        if held is not None and held.state is VersionState.DRAINING:  # back before it went
            self.registry.renumber(held, route.version)
            self._drains.later(self.registry.switch(held))
            log.info("%s serves again", held.label)
            return
        version = self.registry.loading(name, route.version, route.served_id)
        # Serving or draining under another id: the workers hold that number at another
        # precision (or export) now; its id and predictor change together.
        moved = version.served_id != route.served_id
        try:
            item = self.read(name, route.version)
            if item.manifest.model_id != split_served_id(route.served_id)[0]:
                raise ModelStoreError(
                    f"this process's {name} version {route.version} is "
                    f"{item.manifest.model_id}, the workers serve {route.served_id}"
                )
        except (ModelStoreError, ModelNotFound) as exc:
            said = scrub(self.repository, str(getattr(exc, "message", exc)))
            if not moved:  # (one that serves keeps serving as it was)
                self.registry.failed(version, "verify", said)
            self._log_once(name, route.served_id, said)
            return
        # The id the workers hold: it names the precision they chose (``+bf16``), which
        # this process's own reading of the store cannot know.
        predictor = self._make_predictor(item.manifest, item.classes, route.served_id)
        if moved:
            self.registry.reexported(version, route.served_id, item.manifest, predictor)
            log.info("%s serves as the workers hold it now", version.label)
            if version.state is VersionState.DRAINING:  # back before it went
                self._drains.later(self.registry.switch(version))
            return
        self.registry.ready(version, item.manifest, predictor)
        before = self.registry.switch(version)
        self._drains.later(before)
        log.info("%s serves now%s", version.label, f"; {before.label} drains" if before else "")

    def _log_once(self, name: str, served_id: str, reason: str) -> None:
        if (name, served_id) not in self._unreadable:
            self._unreadable[(name, served_id)] = reason
            log.error("the workers serve %s, which this process cannot: %s", served_id, reason)

    # -- asking the workers ------------------------------------------------------------------

    def stop_waiting(self) -> None:
        """The server stops (safe in a signal handler): admin calls waiting for the workers
        answer 503 at their next look, so they do not hold the shutdown up."""
        self._stopping = True

    def _check_stopping(self) -> None:
        if self._stopping:
            raise NotReady("the server is stopping: ask another, or again once it is back")

    async def load(
        self, name: str, version: int | None = None, *, replace: bool = False
    ) -> ModelVersion:
        """Have every worker serve ``name``'s ``version`` (without one: its pin, else its
        newest) beside what serves; answers once the name serves it, or raises why the
        workers gave it up (``ModelLoadFailed``, 507 ``ModelMemoryBudget``), or that it was
        not served within the load deadline and this call's margin. ``replace``: unload
        what serves first. Shielded: a caller that goes away does not stop it."""
        check_name(name)
        if replace and not self._in_place:
            raise InvalidRequest(
                "parameters.replace is for one process: in broker mode every worker loads a "
                "version beside the one serving (MB_MODEL_MEMORY bounds what that takes)"
            )
        return await asyncio.shield(self._load(name, version, replace=replace))

    async def _load(self, name: str, number: int | None, *, replace: bool) -> ModelVersion:
        async with self._lock:
            chosen = self.repository.chosen(name) if number is None else number
            assert chosen is not None  # without the admin route's pin, never unloaded
            try:
                item = await asyncio.to_thread(self.read, name, chosen)
            except ModelStoreError as exc:
                reason = scrub(self.repository, str(exc))
                raise ModelLoadFailed(
                    f"{name} version {chosen}: verify: {reason}", "verify"
                ) from None
            self.registry.expect([name])  # 503, not 404, until it serves
            if replace and self.registry.serving(name) is not None:
                log.warning("replacing %s in place: it answers 503 until version %d serves",
                            name, chosen)  # fmt: skip
                self._coming.add(name)
                try:
                    await self._until_unheld(name, await self.control.pin(name, UNLOADED))
                finally:
                    self._coming.discard(name)
            asked = await self.control.pin(name, number)
            log.info("asked the workers to serve %s version %d", name, chosen)
            return await self._until_served(name, chosen, item.manifest.model_id, asked)

    async def _until_served(
        self, name: str, number: int, model_id: str, asked: int
    ) -> ModelVersion:
        deadline = time.monotonic() + self._load_timeout_s + MARGIN_S
        label = f"{name} version {number} ({model_id})"
        while True:
            self._check_stopping()
            await self.control.refresh()
            serving = self.registry.serving(name)
            exported = serving is not None and split_served_id(serving.served_id)[0] == model_id
            if serving is not None and exported and serving.version == number:
                return serving  # the workers serve it, under this number (verified there)
            # Only what the workers said after acting on this request counts: a failure
            # from before is the last load's, not this one's.
            workers = self.control.view.workers
            if all(w.aimed >= asked for w in workers if w.alive and not w.draining):
                failure = _failure(workers, name, number, self._min_workers)
                if failure is not None:
                    steps, reason = failure
                    if steps != {"interrupted"}:  # (its worker's restart loads it again)
                        self.registry.gave_up(name)  # given up: after an unload, 404 again
                    said = scrub(self.repository, f"{label}: {reason}")
                    if steps == {"budget"}:
                        raise ModelMemoryBudget(said)
                    raise ModelLoadFailed(said, min(steps) if len(steps) == 1 else "load")
            if time.monotonic() > deadline:
                raise ModelLoadFailed(
                    f"{label} was not served within {self._load_timeout_s + MARGIN_S:g} s "
                    "(MB_WORKER_START_TIMEOUT and the time to switch): is every worker live, "
                    "and does each see it on disk?",
                    "timeout",
                )
            await asyncio.sleep(LOOK_S)

    async def unload(self, name: str, number: int | None = None) -> ModelVersion:
        """Have every worker drain and unload ``name`` (until the admin route loads it
        again); answers once none holds a version of it. ``number``, if given, must be the
        version serving (one serves at a time: an unload stops serving the name): else
        ``InvalidRequest``. Shielded, as a load is."""
        check_name(name)
        return await asyncio.shield(self._unload(name, number))

    async def _unload(self, name: str, number: int | None) -> ModelVersion:
        async with self._lock:
            version = self.registry.serving(name)
            if version is None:
                raise ModelNotFound(f"no model named {name!r} is loaded")
            if number is not None and number != version.version:
                raise InvalidRequest(
                    f"{name} serves version {version.version}, not {number}: an unload stops "
                    "serving the name (one version serves at a time); send no version, or "
                    "the one serving"
                )
            await self._until_unheld(name, await self.control.pin(name, UNLOADED))
            return version

    async def _until_unheld(self, name: str, asked: int) -> None:
        deadline = time.monotonic() + self._drains.timeout_s + MARGIN_S
        while True:
            self._check_stopping()
            await self.control.refresh()
            workers = self.control.view.workers
            held = any(m.name == name and m.state.holds_models for w in workers for m in w.models)
            aimed = all(w.aimed >= asked for w in workers if w.alive and not w.draining)
            if aimed and not held and self.registry.serving(name) is None:
                return
            if time.monotonic() > deadline:
                raise DeadlineExceeded(
                    f"the workers still hold a version of {name} after draining for "
                    f"{self._drains.timeout_s + MARGIN_S:g} s"
                )
            await asyncio.sleep(LOOK_S)

    async def reload(self, *, automatic: bool = False) -> None:
        """Have the workers load what is new on disk (``kill -HUP``; ``automatic``: the
        repository poll, which never retries a version that failed)."""
        await self.control.reload(explicit=not automatic)

    async def poll(self, interval_s: float) -> None:
        """Look at the repository every ``interval_s`` and load what is new, forever."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.reload(automatic=True)
            except Exception:  # a bug must not stop the polling
                log.exception("polling the model repository failed")

    # -- what there is ------------------------------------------------------------------------

    def index(self, workers: Sequence[WorkerStatus]) -> list[dict[str, Any]]:
        """Every version on disk or known (``app.services.index``), with the rollouts the
        workers gave up."""
        gave_up = given_up(self.control.view.workers, self._min_workers)
        return index_rows(self.repository, self.registry, workers, gave_up)

    async def aclose(self) -> None:
        await self._drains.aclose()


def _failure(
    workers: Sequence[WorkerView], name: str, number: int, min_workers: int | None
) -> tuple[set[str], str] | None:
    """The steps at which the workers failed ``name``'s ``number`` and why, once its
    rollout is given up (``app.lifecycle.given_up``); None while it may still serve."""
    reason = given_up(workers, min_workers).get((name, number))
    if reason is None:
        return None
    steps = {
        m.step
        for w in workers
        for m in w.models
        if (m.name, m.version) == (name, number) and m.state is VersionState.FAILED
    }
    return steps, reason
