"""A broker front end's models: it loads none (its workers do, and say so in their
heartbeats); it follows them. ``BrokerModels.follow`` switches each name to the version the
routing rule gives (``app.lifecycle.routes``), and the admin routes ask every worker through
Redis (``VersionControl``), then answer once the name serves the version asked for, or with
the reason the workers gave up on it (``app.lifecycle.given_up``).

What a load by the admin route chooses stays chosen, as in-process: a version number pins
it (for every worker, a restarted one too, until the admin route says otherwise), a load
without one goes back to the pin or the newest on disk, and an unload keeps the name
unloaded until the next load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from app.batching import ClusterView, VersionControl, WorkerStatus
from app.errors import (
    DeadlineExceeded,
    InvalidRequest,
    ModelLoadFailed,
    ModelMemoryBudget,
    ModelNotFound,
    ModelStoreError,
    ServerError,
)
from app.lifecycle import UNLOADED, VersionState, given_up
from app.manifest import split_served_id
from app.repository import Repository, VersionOnDisk, check_name
from app.services.index import index_rows
from app.services.models import Drains, PredictorFactory, scrub
from app.services.registry import ModelRegistry, ModelVersion

log = logging.getLogger("app.models")

LOOK_S = 0.2  # how often an admin call waiting for the workers looks at them
# An admin call waits for the workers' own load deadline, and this much more (their next
# heartbeat, and the front end's next look).
MARGIN_S = 10.0


class BrokerModels:
    """The versions a broker front end serves, as its workers decide.

    >>> # models = BrokerModels(registry, repository, transport.models_control, factory,
    >>> #                       dtype="auto", drain_timeout_s=35, load_timeout_s=300)
    >>> # models.follow(view)                       # each look at the workers
    >>> # await models.load("tagger", 3)            # every worker loads it; answers once served
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
    ) -> None:
        self.registry = registry
        self.repository = repository
        self.control = control
        self._make_predictor = make_predictor
        self._dtype = dtype
        self._load_timeout_s = load_timeout_s
        self._min_workers = min_workers
        self._lock = asyncio.Lock()  # one admin call at a time
        self._drains = Drains(registry, _nothing_to_unload, drain_timeout_s, asyncio.Lock())
        self._unreadable: dict[tuple[str, str], str] = {}  # logged once each

    def read(self, name: str, version: int) -> VersionOnDisk:
        """``name``'s ``version`` as this front end needs it: its served id, input size and
        class names (only the class file's sha256 is checked: it holds no weights)."""
        return self.repository.read(name, version, self._dtype, roles=("classes",))

    # -- following the workers ---------------------------------------------------------------

    def follow(self, view: ClusterView) -> None:
        """Switch each name to the version its route names (the workers loaded it, and the
        routing rule says it serves now); a name the admin route unloaded stops serving.
        The version a name moved from drains."""
        for name, pin in view.pins.items():
            if pin == UNLOADED and self.registry.serving(name) is not None:
                self._drains.later(self.registry.retire(name))
                log.info("broker: %s is unloaded", name)
        names = set(self.repository.names())
        for name, route in view.routes.items():
            if view.pins.get(name) == UNLOADED:
                continue
            if name not in names:  # workers serving a model this front end does not have
                self._log_once(name, route.served_id, f"{name!r} is not in its repository")
                continue
            current = self.registry.serving(name)
            if current is not None and current.served_id == route.served_id:
                self.registry.renumber(current, route.version)
                continue
            held = self.registry.of_export(name, route.served_id)
            if held is not None and held.state is VersionState.DRAINING:  # a rollback
                self.registry.renumber(held, route.version)
                self._drains.later(self.registry.switch(held))
                continue
            version = self.registry.loading(name, route.version, route.served_id)
            try:
                item = self.read(name, route.version)
                if item.manifest.model_id != split_served_id(route.served_id)[0]:
                    raise ModelStoreError(
                        f"this front end's {name} version {route.version} is "
                        f"{item.manifest.model_id}, the workers serve {route.served_id}"
                    )
            except (ModelStoreError, ModelNotFound) as exc:
                said = exc.message if isinstance(exc, ServerError) else str(exc)
                self.registry.failed(version, "verify", said)
                self._log_once(name, route.served_id, said)
                continue
            # The id the workers serve: it names the precision they chose (``+bf16``), which
            # this front end's own reading of the store cannot know.
            predictor = self._make_predictor(item.manifest, item.classes, route.served_id)
            self.registry.ready(version, item.manifest, predictor)
            self._drains.later(self.registry.switch(version))
            log.info("broker: %s serves now", version.label)

    def _log_once(self, name: str, served_id: str, reason: str) -> None:
        if (name, served_id) not in self._unreadable:
            self._unreadable[(name, served_id)] = reason
            log.error(
                "broker: the workers serve %s, which this front end cannot: %s", served_id, reason
            )

    # -- the admin routes --------------------------------------------------------------------

    async def load(
        self, name: str, version: int | None = None, *, replace: bool = False
    ) -> ModelVersion:
        """Have every worker load ``name``'s ``version`` (without one: its pin, else its
        newest) beside what it serves; answers once the name serves it by the routing rule,
        or raises why the workers gave it up (``ModelLoadFailed``, 507
        ``ModelMemoryBudget``), or that it was not served within the workers' load deadline
        and this call's margin. Shielded: a caller that goes away does not stop it."""
        check_name(name)
        if replace:
            raise InvalidRequest(
                "replace is for a server with its own workers: broker workers load a version "
                "beside the one serving (bound their memory with MB_MODEL_MEMORY)"
            )
        return await asyncio.shield(self._load(name, version))

    async def _load(self, name: str, number: int | None) -> ModelVersion:
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
            await self.control.pin(name, number)
            log.info("broker: asked the workers to serve %s version %d", name, chosen)
            return await self._until_served(name, chosen, item.manifest.model_id)

    async def _until_served(self, name: str, number: int, model_id: str) -> ModelVersion:
        deadline = time.monotonic() + self._load_timeout_s + MARGIN_S
        while True:
            await self.control.refresh()
            serving = self.registry.serving(name)
            exported = serving is not None and split_served_id(serving.served_id)[0] == model_id
            if serving is not None and exported and serving.version == number:
                return serving  # the workers serve it, under this number (verified there)
            workers = self.control.view.workers
            reason = given_up(workers, self._min_workers).get((name, number))
            if reason is not None:
                label = f"{name} version {number} ({model_id})"
                steps = {
                    m.step
                    for w in workers
                    for m in w.models
                    if (m.name, m.version) == (name, number) and m.state is VersionState.FAILED
                }
                if steps == {"budget"}:
                    raise ModelMemoryBudget(f"{label}: {reason}")
                step = min(steps) if len(steps) == 1 else "load"
                raise ModelLoadFailed(f"{label}: {reason}", step)
            if time.monotonic() > deadline:
                raise ModelLoadFailed(
                    f"{name} version {number} ({model_id}) was not served within "
                    f"{self._load_timeout_s + MARGIN_S:g} s (MB_WORKER_START_TIMEOUT and "
                    "the time to switch): is every worker live, and does each see it on disk?",
                    "timeout",
                )
            await asyncio.sleep(LOOK_S)

    async def unload(self, name: str) -> ModelVersion:
        """Have every worker drain and unload ``name`` (until the admin route loads it
        again); answers once none holds a version of it."""
        check_name(name)
        return await asyncio.shield(self._unload(name))

    async def _unload(self, name: str) -> ModelVersion:
        async with self._lock:
            version = self.registry.serving(name)
            if version is None:
                raise ModelNotFound(f"no model named {name!r} is loaded")
            await self.control.pin(name, UNLOADED)
            deadline = time.monotonic() + self._drains.timeout_s + MARGIN_S
            while True:
                await self.control.refresh()
                held = any(
                    m.name == name and m.state.holds_models
                    for w in self.control.view.workers
                    for m in w.models
                )
                if not held:
                    return version
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(
                        f"the workers still hold a version of {name} after draining for "
                        f"{self._drains.timeout_s + MARGIN_S:g} s"
                    )
                await asyncio.sleep(LOOK_S)

    # -- what there is ------------------------------------------------------------------------

    def index(self, workers: Sequence[WorkerStatus]) -> list[dict[str, Any]]:
        """Every version on disk or known (``app.services.index``), with the rollouts the
        workers gave up."""
        gave_up = given_up(self.control.view.workers, self._min_workers)
        return index_rows(self.repository, self.registry, workers, gave_up)

    async def aclose(self) -> None:
        await self._drains.aclose()


async def _nothing_to_unload(version: ModelVersion) -> None:
    """A front end holds no weights: its workers unload their own."""
