"""Models coming and going while the server serves: the ``ModelManager`` reads versions from
the repository, has its host (the worker pool) load them beside what serves, switches names
in the registry, and unloads what drained.

The order of a load, and why (``docs/models.md``):

1. read and verify the version's store (every sha256) here, and work out its served id;
2. the host loads it beside the serving version, one worker at a time, each verifying,
   self-testing and warming it up (``ModelHost.load``);
3. the registry marks it ready and switches the name to it, in one step;
4. the version before drains: requests admitted for it finish on it;
5. once drained, the host unloads it and gives its memory back.

A load that fails at any step leaves what served before serving, answers with the reason
(``ModelLoadFailed``), logs one line and is counted (``on_load``). ``replace=True`` trades
that for memory: the old version drains and unloads first, and the name answers 503 until
the new one serves (the documented gap).

In broker mode the front end loads nothing: the workers do, and say so in their heartbeats;
``follow`` switches each name to the version the routing rule gives
(``app.broker.routing``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from app.batching import WorkerStatus
from app.errors import (
    ModelLoadFailed,
    ModelMemoryBudget,
    ModelNotFound,
    ModelStoreError,
    ServerError,
)
from app.manifest import Manifest, read_classes, read_manifest
from app.repository import ModelSpec, ModelState, Repository, Route, check_name
from app.services.predictor import Predictor
from app.services.registry import ModelRegistry, ModelVersion

log = logging.getLogger("app.models")

# Makes the Predictor of a version: its manifest, its class names and its served id.
PredictorFactory = Callable[[Manifest, list[str], str], Predictor]


class ModelHost(Protocol):
    """What loads models for this process: ``app.workers.pool.WorkerPool`` (or a fake)."""

    async def load(self, spec: ModelSpec) -> Sequence[Any]:
        """Load ``spec`` beside the models held; ``ModelLoadFailed`` says why not."""

    async def unload(self, served_id: str) -> None:
        """Drop the model, giving its memory back; done when it is back."""


# A load of (name, version) ended after seconds; the step it failed at, or None if it serves.
LoadObserver = Callable[[str, int, float, str | None], None]


@dataclass(frozen=True)
class VersionOnDisk:
    """A version read from the repository: what to load, and what a Predictor needs."""

    spec: ModelSpec
    manifest: Manifest
    classes: list[str]


class ModelManager:
    """Loads, switches and unloads the versions of every model this process serves.

    >>> # manager = ModelManager(registry, repository, pool, make_predictor, dtype="auto")
    >>> # await manager.serve_started([...])       # what the workers loaded at start
    >>> # version = await manager.load("tagger")   # the newest on disk; the old one drains
    >>> # await manager.unload("tagger")
    """

    def __init__(
        self,
        registry: ModelRegistry,
        repository: Repository,
        host: ModelHost | None,
        make_predictor: PredictorFactory,
        *,
        dtype: str,
        drain_timeout_s: float,
        verify: bool = True,
        roles: Collection[str] | None = None,
        on_load: LoadObserver | None = None,
    ) -> None:
        self.registry = registry
        self.repository = repository
        self.host = host  # None: a broker front end, which follows the workers
        self._make_predictor = make_predictor
        self._dtype = dtype
        self._drain_timeout_s = drain_timeout_s
        self._verify = verify
        self._roles = roles
        self._on_load = on_load
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._drains: set[asyncio.Task[None]] = set()
        self._failed: set[tuple[str, int]] = set()  # versions automatic reloads skip
        self._unreadable: dict[tuple[str, str], str] = {}  # broker mode: logged once

    # -- reading the repository --------------------------------------------------------------

    def read(self, name: str, version: int) -> VersionOnDisk:
        """``name``'s ``version`` from the repository, verified (every sha256, or the class
        names only for a broker front end): ``ModelNotFound``, ``ModelStoreError``."""
        store = self.repository.path(name, version)
        manifest = read_manifest(store, verify=self._verify, roles=self._roles)
        classes = read_classes(store, manifest)
        spec = ModelSpec(
            name,
            version,
            str(store),
            manifest.served_id(self._dtype),
            manifest.input.image_shape,
        )
        return VersionOnDisk(spec, manifest, classes)

    def _unverified_id(self, name: str, version: int) -> str:
        """The served id a version's manifest names, unverified ("" if it has none)."""
        try:
            store = self.repository.path(name, version)
            return read_manifest(store, verify=False).served_id(self._dtype)
        except (ModelStoreError, ModelNotFound):
            return ""

    def read_chosen(self) -> list[VersionOnDisk]:
        """The version of every model to serve at start (its pin, else its newest)."""
        names = self.repository.names()
        if not names:
            raise ModelStoreError(
                f"no model in {self.repository.root}: export one with `python -m app.export` "
                "(or `make model`); a repository holds DIR/<name>/<version>/ stores"
            )
        default = self.registry.default_name
        if default is not None and default not in names:
            raise ModelStoreError(
                f"MB_DEFAULT_MODEL={default}, but the repository holds {', '.join(names)}"
            )
        return [self.read(name, self.repository.chosen(name)) for name in names]

    # -- serving -----------------------------------------------------------------------------

    def serve_started(self, loaded: Sequence[VersionOnDisk]) -> None:
        """The versions the host loaded as it started: ready, and serving their names."""
        for item in loaded:
            version = self.registry.loading(item.spec.name, item.spec.version, item.spec.served_id)
            self._serve(version, item)

    def _serve(self, version: ModelVersion, item: VersionOnDisk) -> ModelVersion | None:
        predictor = self._make_predictor(item.manifest, item.classes, item.spec.served_id)
        self.registry.ready(version, item.manifest, predictor)
        old = self.registry.switch(version)
        if old is not None:
            self._drain_later(old)
        return old

    async def load(
        self, name: str, version: int | None = None, *, replace: bool = False
    ) -> ModelVersion:
        """Load ``name``'s ``version`` (default: its pin, else its newest) beside what
        serves, then switch the name to it; answers once it serves (the version before
        drains in the background). Shielded: a caller that goes away does not stop it."""
        return await asyncio.shield(self._load(name, version, replace=replace))

    async def _load(self, name: str, number: int | None, *, replace: bool) -> ModelVersion:
        if self.host is None:
            raise ModelLoadFailed(
                "this front end loads no models: its workers do (send them SIGHUP, or set "
                "MB_REPOSITORY_POLL_S; docs/models.md)",
                "load",
            )
        async with self._lock:
            check_name(name)
            number = self.repository.chosen(name) if number is None else number
            started = time.monotonic()
            try:
                item = await asyncio.to_thread(self.read, name, number)
            except ModelStoreError as exc:
                reason = f"verify: {self._scrub(str(exc))}"
                failed = self.registry.loading(name, number, self._unverified_id(name, number))
                self.registry.failed(failed, reason)
                self._failed.add((name, number))
                self._observe(name, number, started, "verify")
                log.error("loading %s version %d failed: %s", name, number, exc)
                raise ModelLoadFailed(f"{name} version {number}: {reason}", "verify") from None
            current = self.registry.serving(name)
            if current is not None and current.served_id == item.spec.served_id:
                self.registry.renumber(current, number)  # already serving exactly this
                return current
            version = self.registry.loading(name, number, item.spec.served_id)
            if version.state is ModelState.DRAINING:  # a rollback before it was unloaded
                self.registry.revive(version)
                self.registry.renumber(version, number)
                self._switch_to(version)
                self._observe(name, number, started, None)
                return version
            if replace and current is not None:
                log.warning(
                    "replacing %s in place: the name answers 503 until %s serves",
                    current.label,
                    item.spec.served_id,
                )
                self.registry.retire(name, coming_back=True)
                await self._unload_when_drained(current)
            try:
                await self.host.load(item.spec)
            except ServerError as exc:
                step = exc.step if isinstance(exc, ModelLoadFailed) else "load"
                reason = f"{step}: {self._scrub(exc.message)}"
                self.registry.failed(version, reason)
                self._failed.add((name, number))
                self._observe(name, number, started, step)
                log.error("loading %s failed: %s; %s", version.label, exc.message, _still(current))
                said = f"{version.label}: {reason}"
                if isinstance(exc, ModelMemoryBudget):  # keeps its own type (507)
                    raise ModelMemoryBudget(said) from None
                raise ModelLoadFailed(said, step) from None
            self._serve(version, item)
            self._failed.discard((name, number))
            self._observe(name, number, started, None)
            log.info(
                "%s serves now (loaded in %.1f s)%s",
                version.label,
                time.monotonic() - started,
                f"; {current.label} drains" if current is not None and not replace else "",
            )
            return version

    def _switch_to(self, version: ModelVersion) -> None:
        old = self.registry.switch(version)
        if old is not None:
            self._drain_later(old)

    async def unload(self, name: str) -> ModelVersion:
        """Stop serving ``name``: its version drains (requests admitted for it finish), then
        its models are unloaded; answers once the memory is given back. Shielded, as a
        load is."""
        return await asyncio.shield(self._unload(name))

    async def _unload(self, name: str) -> ModelVersion:
        async with self._lock:
            check_name(name)
            version = self.registry.retire(name)
            if version is None:
                raise ModelNotFound(f"no model named {name!r} is loaded")
            await self._unload_when_drained(version)
            return version

    async def reload(self, *, automatic: bool = False) -> list[ModelVersion]:
        """Load whatever is new on disk (``kill -HUP``, ``MB_REPOSITORY_POLL_S``): each name
        whose chosen version is not the one serving. Failures are logged and counted, not
        raised; ``automatic`` (a poll) does not retry a version that failed before."""
        loaded = []
        for name in self.repository.names():
            try:
                number = self.repository.chosen(name)
            except ServerError as exc:
                log.error("reload: %s", exc.message)
                continue
            current = self.registry.serving(name)
            if current is not None and current.version == number:
                continue
            if automatic and (name, number) in self._failed:
                continue
            with contextlib.suppress(ServerError):  # logged and counted by the load
                loaded.append(await self.load(name, number))
        return loaded

    async def poll(self, interval_s: float) -> None:
        """Look at the repository every ``interval_s`` and load what is new, forever."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.reload(automatic=True)
            except Exception:  # a bug must not stop the polling
                log.exception("polling the model repository failed")

    # -- broker mode: following the workers --------------------------------------------------

    def follow(self, routes: Mapping[str, Route]) -> None:
        """Switch each name to the version its route names (the workers loaded it, and the
        routing rule says it serves now); a version no longer routed drains."""
        names = set(self.repository.names())
        for name, route in routes.items():
            if name not in names:  # workers serving a model this front end does not have
                self._log_once(name, route.served_id, f"{name!r} is not in its repository")
                continue
            current = self.registry.serving(name)
            if current is not None and current.served_id == route.served_id:
                self.registry.renumber(current, route.version)
                continue
            version = self.registry.loading(name, route.version, route.served_id)
            if version.state is ModelState.DRAINING:
                self.registry.revive(version)
                self.registry.renumber(version, route.version)
                self._switch_to(version)
                continue
            if version.state is not ModelState.LOADING:
                continue
            try:
                item = self.read(name, route.version)
                if item.spec.served_id != route.served_id:
                    raise ModelStoreError(
                        f"this front end's {name} version {route.version} is "
                        f"{item.spec.served_id}, the workers serve {route.served_id}"
                    )
            except (ModelStoreError, ModelNotFound) as exc:
                self.registry.failed(
                    version, exc.message if isinstance(exc, ServerError) else str(exc)
                )
                key = (name, route.served_id)
                if key not in self._unreadable:
                    self._unreadable[key] = str(exc)
                    log.error("broker: cannot serve %s: %s", route.served_id, exc)
                continue
            self._serve(version, item)
            log.info("broker: %s serves now", version.label)

    def _log_once(self, name: str, served_id: str, reason: str) -> None:
        if (name, served_id) not in self._unreadable:
            self._unreadable[(name, served_id)] = reason
            log.error(
                "broker: the workers serve %s, which this front end cannot: %s", served_id, reason
            )

    def _where(self) -> str:
        return "this front end's repository"

    # -- what there is ------------------------------------------------------------------------

    def index(self, workers: Sequence[WorkerStatus]) -> list[dict[str, Any]]:
        """Every version on disk or known (loading, ready, draining, failed), by name and
        number: its served id, state, reason, requests in flight, and what it costs a worker
        holding it (the most any reports). A version on disk that is not loaded is
        ``unavailable``, as Triton calls it."""
        memory: dict[str, int] = {}
        holders: dict[str, int] = {}
        for worker in workers:
            for held in worker.models:
                holders[held.served_id] = holders.get(held.served_id, 0) + (
                    held.state == ModelState.READY
                )
                if held.memory_bytes is not None:
                    memory[held.served_id] = max(memory.get(held.served_id, 0), held.memory_bytes)
        rows: dict[tuple[str, int, str], dict[str, Any]] = {}
        for version in self.registry.versions():
            serving = self.registry.serving(version.name) is version
            rows[(version.name, version.version, version.served_id)] = {
                "name": version.name,
                "version": str(version.version),
                "model_id": version.served_id,
                "state": version.state.value,
                "serving": serving,
                "reason": version.reason or "",
                "in_flight": version.in_flight,
                "workers": holders.get(version.served_id, 0),
                "memory_bytes": memory.get(version.served_id),
            }
        known = {(name, number) for name, number, _ in rows}
        for name in self.repository.names():
            for number in self.repository.versions(name):
                if (name, number) not in known:
                    rows[(name, number, "")] = {
                        "name": name, "version": str(number), "model_id": None,
                        "state": "unavailable", "serving": False, "reason": "", "in_flight": 0,
                        "workers": 0, "memory_bytes": None,
                    }  # fmt: skip
        return [rows[key] for key in sorted(rows)]

    # -- draining ----------------------------------------------------------------------------

    def _drain_later(self, version: ModelVersion) -> None:
        task = asyncio.get_running_loop().create_task(self._finish(version))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def _finish(self, version: ModelVersion) -> None:
        await self._wait_drained(version)
        async with self._lock:
            await self._unload_drained(version)

    async def _wait_drained(self, version: ModelVersion) -> None:
        try:
            await asyncio.wait_for(version.drained.wait(), self._drain_timeout_s)
        except TimeoutError:
            log.warning(
                "%s still had %d request(s) after %.0f s of draining; unloading it anyway",
                version.label,
                version.in_flight,
                self._drain_timeout_s,
            )

    async def _unload_when_drained(self, version: ModelVersion) -> None:
        await self._wait_drained(version)
        await self._unload_drained(version)

    async def _unload_drained(self, version: ModelVersion) -> None:
        if version.state is not ModelState.DRAINING:
            return  # revived meanwhile, or already gone
        shared = [v for v in self.registry.holders(version.served_id) if v is not version]
        if self.host is not None and not shared:
            try:
                await self.host.unload(version.served_id)
            except ServerError as exc:
                log.error("unloading %s failed: %s", version.label, exc.message)
        self.registry.gone(version)
        log.info("%s unloaded", version.label)

    async def aclose(self) -> None:
        for task in list(self._drains):
            task.cancel()
        await asyncio.gather(*self._drains, return_exceptions=True)

    def _scrub(self, message: str) -> str:
        """A reason without this machine's paths (it goes into answers and /info)."""
        root = self.repository.root
        for where in (str(root.resolve()), str(root)):
            message = message.replace(where, "<repository>")
        return message

    def _observe(self, name: str, number: int, started: float, step: str | None) -> None:
        if self._on_load is not None:
            self._on_load(name, number, time.monotonic() - started, step)


def _still(current: ModelVersion | None) -> str:
    return f"{current.label} still serves" if current is not None else "nothing served it before"
