"""The models a worker pool hosts: every worker holds every model the pool serves, so several
models share the cores. A new version loads beside the others on one worker at a time (at
most ``app.lifecycle.LOADERS_PER_HOST`` per host), each in a thread of the worker's own while
that worker goes on running batches (``app.workers.serve``); a restarted worker catches up
on what was loaded and unloaded while it was down. Under ``MB_DTYPE=auto`` the first worker
to load an export chooses its precision by measurement, and every other worker of the host
loads it in that one: one id per export on a host (``decided``). How versions come and go:
``docs/models.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from app.errors import ModelLoadFailed, WorkerDied
from app.lifecycle import LOADERS_PER_HOST, ModelSpec
from app.manifest import served_model_id, split_served_id
from app.workers.handle import Reply, WorkerHandle, retrieve
from app.workers.messages import LoadDone, LoadModel, ModelLoaded, UnloadModel

if TYPE_CHECKING:
    from app.plan import WorkerConfig

log = logging.getLogger("app.workers.pool")

# A worker that neither loads nor says it gave up (at MB_WORKER_START_TIMEOUT) within this
# much more is stuck: it is killed, and restarts with the models served before.
STUCK_S = 30.0


class PoolModels:
    """What every worker of a pool holds, by served id (``specs``), and the loads and
    unloads that change it. ``workers`` gives the pool's workers as they are now;
    ``ids`` numbers every request to a worker (batches and these share one counter).

    >>> # models = PoolModels(specs, lambda: pool.workers, config, buffer_size, ids, 300.0)
    >>> # await models.load(spec)            # worker by worker; ModelLoadFailed if it fails
    >>> # await models.unload(spec.served_id)
    """

    def __init__(
        self,
        specs: Sequence[ModelSpec],
        workers: Callable[[], Sequence[WorkerHandle]],
        config: WorkerConfig,
        buffer_size: int,
        ids: itertools.count[int],
        timeout_s: float,
    ) -> None:
        self.specs: dict[str, ModelSpec] = {spec.served_id: spec for spec in specs}
        self._workers = workers
        self.config = config
        self.buffer_size = buffer_size
        self._ids = ids
        self.timeout_s = timeout_s
        self.lock = asyncio.Lock()  # one load or unload at a time, and a catch-up
        self._loaders = asyncio.Semaphore(LOADERS_PER_HOST)
        self.decisions: dict[str, str] = {}  # export (model id) -> the precision chosen

    def decided(self, spec: ModelSpec) -> ModelSpec:
        """``spec`` in the precision a worker of this host chose for its export, if one
        did (under ``MB_DTYPE=auto``); else as it is."""
        model_id = split_served_id(spec.served_id)[0]
        dtype = self.decisions.get(model_id) if spec.dtype == "auto" else None
        return spec if dtype is None else spec.decided(dtype, served_model_id(model_id, dtype))

    def learn(self, requested: ModelSpec, report: ModelLoaded) -> ModelSpec:
        """What a worker chose for ``requested`` (its report): the spec every other worker
        loads from now on."""
        if requested.dtype == "auto":
            self.decisions[split_served_id(requested.served_id)[0]] = report.dtype
        return requested.decided(report.dtype, report.served_id)

    async def load(self, spec: ModelSpec) -> list[ModelLoaded]:
        """Load ``spec`` beside the models held, on one worker at a time, each going on
        with its batches meanwhile, and add it to what every worker holds from now on; each
        worker's report. If it fails anywhere (a bad file, a failed self-test, over
        ``MB_MODEL_MEMORY``, past the load deadline, a worker that dies), the workers that
        loaded it drop it again and ``ModelLoadFailed`` says why: the models served before
        are untouched."""
        image_bytes = int(np.prod(spec.image_shape))
        if image_bytes > self.buffer_size:
            raise ModelLoadFailed(
                f"one {'x'.join(map(str, spec.image_shape))} image takes {image_bytes} bytes; the "
                f"workers' buffers hold {self.buffer_size} (sized at start for the models then "
                "and MB_BATCH_SIZE): start the server with this model in the repository",
                "load",
            )
        async with self.lock:
            if spec.served_id in self.specs:
                return [
                    w.models[spec.served_id] for w in self._workers() if w.holds(spec.served_id)
                ]
            loaded: list[WorkerHandle] = []
            reports: list[ModelLoaded] = []
            try:
                for worker in list(self._workers()):
                    if not (worker.alive and worker.ready):
                        continue  # restarting: it catches up once it is back (catch_up)
                    async with self._loaders:
                        reply = await self.ask(
                            worker, LoadModel(next(self._ids), spec, self.timeout_s)
                        )
                    assert isinstance(reply, LoadDone)
                    loaded.append(worker)
                    reports.append(reply.model)
                if not reports:
                    raise ModelLoadFailed("no model worker is running to load it", "load")
            except BaseException:
                for worker in loaded:
                    with contextlib.suppress(Exception):
                        await self.ask(worker, UnloadModel(next(self._ids), spec.served_id))
                raise
            self.specs[spec.served_id] = spec
            return reports

    async def unload(self, served_id: str) -> None:
        """Drop a model from every worker (its memory goes back to the kernel) and from what
        a restarted worker loads. The caller has let its requests finish."""
        async with self.lock:
            self.specs.pop(served_id, None)
            for worker in list(self._workers()):
                if worker.holds(served_id):  # one that fails (dies) restarts without it
                    with contextlib.suppress(WorkerDied, ModelLoadFailed):
                        await self.ask(worker, UnloadModel(next(self._ids), served_id))

    async def catch_up(self, worker: WorkerHandle) -> None:
        """A restarted worker loads what was loaded while it was down, and drops what was
        unloaded, before it serves those models."""
        async with self.lock:
            if not worker.alive:
                return
            for served_id in set(worker.models) - set(self.specs):
                await self.ask(worker, UnloadModel(next(self._ids), served_id))
            for served_id, spec in self.specs.items():
                if served_id not in worker.models:
                    async with self._loaders:
                        await self.ask(worker, LoadModel(next(self._ids), spec, self.timeout_s))

    async def ask(self, worker: WorkerHandle, message: LoadModel | UnloadModel) -> Reply:
        """Send a load or an unload to ``worker`` (it goes on with its batches); a worker
        that dies meanwhile fails it, and one that neither answers nor gives up by the load
        deadline (and ``STUCK_S`` more) is killed (it restarts with the models served)."""
        what = "loading" if isinstance(message, LoadModel) else "unloading"
        if not worker.alive:
            raise ModelLoadFailed(
                f"worker {worker.index} died before {what} the model", "worker crash"
            )
        future = worker.send(message)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s + STUCK_S)
        except WorkerDied:
            raise ModelLoadFailed(
                f"worker {worker.index} died while {what} the model", "worker crash"
            ) from None
        except TimeoutError:
            log.error("worker %d is stuck %s a model: killing it", worker.index, what)
            worker.kill()
            future.add_done_callback(retrieve)
            raise ModelLoadFailed(
                f"worker {worker.index} took over {self.timeout_s:g} s {what} the model",
                "timeout",
            ) from None
