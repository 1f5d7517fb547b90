"""Models coming and going while the server serves, in-process: the ``ModelManager`` reads
versions from the repository, has its host (the worker pool) load them beside what serves,
switches names in the registry, and unloads what drained. (A broker front end loads nothing:
``app.services.following`` asks the workers through Redis.)

The order of a load, and why (``docs/models.md``):

1. read and verify the version's store (every sha256) here, and work out its served id;
2. the host loads it beside the serving version on every worker, each verifying,
   self-testing and warming it up (``ModelHost.load``), while the others serve;
3. the registry marks it ready and switches the name to it, in one step;
4. the version before drains: requests admitted for it finish on it;
5. once drained, the host unloads it and gives its memory back.

Which version a name should serve is ``app.lifecycle.chosen_version``: a version the admin
route loaded stays chosen (a reload or a poll does not undo it) until the admin route loads
another, or loads the name without a version (its pin, else its newest, again).

A load that fails at any step leaves what served before serving, answers with the reason
(``ModelLoadFailed``), shows as ``failed`` on its own row of the index, logs one line and is
counted (``on_load``). ``replace=True`` trades that for memory: the old version drains and
unloads first, and the name answers 503 until the new one serves (the documented gap).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from app.batching import ModelHost, WorkerStatus
from app.errors import (
    ModelLoadFailed,
    ModelMemoryBudget,
    ModelNotFound,
    ModelStoreError,
    ServerError,
)
from app.lifecycle import UNLOADED, AdminPin, VersionState
from app.manifest import Manifest
from app.repository import Repository, VersionOnDisk, check_name
from app.services.index import index_rows
from app.services.predictor import Predictor
from app.services.registry import ModelRegistry, ModelVersion

log = logging.getLogger("app.models")

# Makes the Predictor of a version: its manifest, its class names and its served id.
PredictorFactory = Callable[[Manifest, list[str], str], Predictor]
# A load of (name, version) ended after seconds; the step it failed at, or None if it serves.
LoadObserver = Callable[[str, int, float, str | None], None]


class Models(Protocol):
    """What the routes and the engine ask of the models a process serves, in-process
    (``ModelManager``) or as a broker front end (``app.services.following.BrokerModels``)."""

    registry: ModelRegistry
    repository: Repository

    async def load(
        self, name: str, version: int | None = None, *, replace: bool = False
    ) -> ModelVersion: ...

    async def unload(self, name: str) -> ModelVersion: ...

    def index(self, workers: Sequence[WorkerStatus]) -> list[dict[str, Any]]: ...

    async def aclose(self) -> None: ...


class Drains:
    """Versions that stopped serving, each waiting for its last request (at most
    ``timeout_s``) before ``unload`` gives its memory back and the registry forgets it."""

    def __init__(
        self,
        registry: ModelRegistry,
        unload: Callable[[ModelVersion], Awaitable[None]],
        timeout_s: float,
        lock: asyncio.Lock,
    ) -> None:
        self.registry = registry
        self._unload = unload
        self.timeout_s = timeout_s
        self._lock = lock  # the owner's: one load or unload at a time
        self._tasks: set[asyncio.Task[None]] = set()

    def later(self, version: ModelVersion | None) -> None:
        """Unload ``version`` once drained, in the background."""
        if version is None:
            return
        task = asyncio.get_running_loop().create_task(self._finish(version))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _finish(self, version: ModelVersion) -> None:
        await self.wait(version)
        async with self._lock:
            await self.unload_drained(version)

    async def wait(self, version: ModelVersion) -> None:
        try:
            await asyncio.wait_for(version.drained.wait(), self.timeout_s)
        except TimeoutError:
            log.warning(
                "%s still had %d request(s) after %.0f s of draining; unloading it anyway",
                version.label,
                version.in_flight,
                self.timeout_s,
            )

    async def now(self, version: ModelVersion) -> None:
        """Wait for ``version`` to drain, then unload it (the caller holds the lock)."""
        await self.wait(version)
        await self.unload_drained(version)

    async def unload_drained(self, version: ModelVersion) -> None:
        if version.state is not VersionState.DRAINING:
            return  # serving again (a rollback), or gone already
        shared = [v for v in self.registry.holders(version.served_id) if v is not version]
        if not shared:  # the same export under another name keeps its models
            await self._unload(version)
        self.registry.gone(version)
        log.info("%s unloaded", version.label)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class ModelManager:
    """Loads, switches and unloads the versions of every model this process serves, on its
    ``host`` (the worker pool).

    >>> # manager = ModelManager(registry, repository, pool, make_predictor, dtype="auto",
    >>> #                        drain_timeout_s=35)
    >>> # manager.serve_started(loaded)         # what the pool loaded as it started
    >>> # version = await manager.load("tagger", 3)   # beside what serves, then switched
    >>> # await manager.unload("tagger")        # drained, then its memory given back
    """

    def __init__(
        self,
        registry: ModelRegistry,
        repository: Repository,
        host: ModelHost,
        make_predictor: PredictorFactory,
        *,
        dtype: str,
        drain_timeout_s: float,
        on_load: LoadObserver | None = None,
    ) -> None:
        self.registry = registry
        self.repository = repository
        self.host = host
        self._make_predictor = make_predictor
        self._dtype = dtype
        self._on_load = on_load
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._admin: dict[str, AdminPin] = {}  # what the admin route loaded, or unloaded
        self._drains = Drains(registry, self._unload_models, drain_timeout_s, self._lock)

    # -- reading the repository --------------------------------------------------------------

    def read(self, name: str, version: int) -> VersionOnDisk:
        """``name``'s ``version`` from the repository, every sha256 verified:
        ``ModelNotFound``, ``ModelStoreError``."""
        return self.repository.read(name, version, self._dtype)

    def chosen(self, name: str) -> int | None:
        """The version ``name`` should serve (``app.lifecycle.chosen_version``)."""
        return self.repository.chosen(name, self._admin.get(name))

    # -- serving -----------------------------------------------------------------------------

    def serve_started(self, loaded: Sequence[VersionOnDisk]) -> None:
        """The versions the host loaded as it started: ready, and serving their names."""
        for item in loaded:
            spec = self.host.decided(item.spec)
            version = self.registry.loading(spec.name, spec.version, spec.served_id)
            self._serve(version, item)

    def _serve(self, version: ModelVersion, item: VersionOnDisk) -> None:
        """``version`` serves now, under the id its workers' precision gives it."""
        served_id = self.host.decided(item.spec).served_id
        predictor = self._make_predictor(item.manifest, item.classes, served_id)
        self.registry.ready(version, item.manifest, predictor, served_id)
        self._drains.later(self.registry.switch(version))

    async def load(
        self, name: str, version: int | None = None, *, replace: bool = False
    ) -> ModelVersion:
        """The admin route's load: ``name``'s ``version`` stays chosen from now on (without
        one, its pin or newest again); loaded beside what serves, then switched to. Answers
        once it serves (the version before drains in the background). Shielded: a caller
        that goes away does not stop it."""
        check_name(name)
        if version is None:
            self._admin.pop(name, None)
        else:
            self._admin[name] = version
        return await asyncio.shield(self._load(name, version, replace=replace))

    async def _load(self, name: str, number: int | None, *, replace: bool) -> ModelVersion:
        async with self._lock:
            chosen = self.chosen(name) if number is None else number
            if chosen is None:  # unloaded by the admin route, and asked without a version
                raise ModelNotFound(f"no model named {name!r} is loaded")
            return await self._load_version(name, chosen, replace=replace)

    async def _load_version(self, name: str, number: int, *, replace: bool) -> ModelVersion:
        started = time.monotonic()
        try:
            item = await asyncio.to_thread(self.read, name, number)
        except ModelStoreError as exc:
            claimed = self.repository.claimed_id(name, number, self._dtype)
            failed = self.registry.loading(name, number, claimed)
            raise self._failed(failed, "verify", str(exc), started) from None
        current = self.registry.serving(name)
        held = self.registry.of_export(name, self.host.decided(item.spec).served_id)
        if held is not None and held.state in (VersionState.SERVING, VersionState.DRAINING):
            # Already this export (published again under another number), or a rollback to
            # a version still draining: it serves, with no load.
            self.registry.renumber(held, number)
            self._drains.later(self.registry.switch(held))
            self._observe(name, number, started, None)
            return held
        version = self.registry.loading(name, number, item.spec.served_id)
        if replace and current is not None:
            log.warning(
                "replacing %s in place: the name answers 503 until %s serves",
                current.label,
                item.spec.served_id,
            )
            self.registry.retire(name, coming_back=True)
            await self._drains.now(current)
        try:
            await self.host.load(item.spec)
        except ServerError as exc:
            step = exc.step if isinstance(exc, ModelLoadFailed) else "load"
            raise self._failed(version, step, exc.message, started, budget=exc) from None
        self._serve(version, item)
        self._observe(name, number, started, None)
        log.info(
            "%s serves now (loaded in %.1f s)%s",
            version.label,
            time.monotonic() - started,
            f"; {current.label} drains" if current is not None and not replace else "",
        )
        return version

    def _failed(
        self,
        version: ModelVersion,
        step: str,
        message: str,
        started: float,
        budget: ServerError | None = None,
    ) -> ServerError:
        """Record a failed load on its own row, log and count it; the error to answer."""
        reason = self._scrub(message)
        self.registry.failed(version, step, reason)
        self._observe(version.name, version.version, started, step)
        current = self.registry.serving(version.name)
        log.error(
            "loading %s failed: %s: %s; %s",
            version.label,
            step,
            reason,
            f"{current.label} still serves" if current else "nothing served it before",
        )
        said = f"{version.label}: {step}: {reason}"
        if isinstance(budget, ModelMemoryBudget):  # keeps its own type (507)
            return ModelMemoryBudget(said)
        return ModelLoadFailed(said, step)

    async def _unload_models(self, version: ModelVersion) -> None:
        try:
            await self.host.unload(version.served_id)
        except ServerError as exc:
            log.error("unloading %s failed: %s", version.label, exc.message)

    async def unload(self, name: str) -> ModelVersion:
        """Stop serving ``name`` (until the admin route loads it again): its version drains
        (requests admitted for it finish), then its models are unloaded; answers once the
        memory is given back. Shielded, as a load is."""
        check_name(name)
        return await asyncio.shield(self._unload(name))

    async def _unload(self, name: str) -> ModelVersion:
        async with self._lock:
            version = self.registry.retire(name)
            if version is None:
                raise ModelNotFound(f"no model named {name!r} is loaded")
            self._admin[name] = UNLOADED
            await self._drains.now(version)
            return version

    async def reload(self, *, automatic: bool = False) -> list[ModelVersion]:
        """Load what is new on disk (``kill -HUP``, ``MB_REPOSITORY_POLL_S``): each name
        whose chosen version is not the one serving. Failures are logged and counted, not
        raised; ``automatic`` (a poll) does not retry a version that failed before."""
        loaded = []
        for name in self.repository.names():
            async with self._lock:
                try:
                    number = self.chosen(name)
                except ServerError as exc:
                    log.error("reload: %s", exc.message)
                    continue
                current = self.registry.serving(name)
                if number is None or (current is not None and current.version == number):
                    continue
                before = self.registry.get(name, number)
                if automatic and before is not None and before.state is VersionState.FAILED:
                    continue
                try:
                    loaded.append(await self._load_version(name, number, replace=False))
                except ServerError:
                    continue  # logged and counted by the load
        return loaded

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
        """Every version on disk or known, by name and number (``app.services.index``)."""
        return index_rows(self.repository, self.registry, workers)

    async def aclose(self) -> None:
        await self._drains.aclose()

    def _scrub(self, message: str) -> str:
        return scrub(self.repository, message)

    def _observe(self, name: str, number: int, started: float, step: str | None) -> None:
        if self._on_load is not None:
            self._on_load(name, number, time.monotonic() - started, step)


def scrub(repository: Repository, message: str) -> str:
    """A reason without this machine's paths (it goes into answers and /info)."""
    root = repository.root
    for where in (str(root.resolve()), str(root)):
        message = message.replace(where, "<repository>")
    return message
