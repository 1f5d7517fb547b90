"""The worker pool: model worker processes on this machine, as a ``Transport``.

It fills ``app.batching.Transport``: ``start``/``aclose``, ``run_batch`` (the Streamer's
batch function), ``capacity``, ``batch_size``, ``ready`` and ``worker_status()``; and the
model host the registry drives (``load``/``unload``): every worker holds every model the
pool serves, so several models share the cores, and a new version is loaded one worker at a
time while the others serve. Replies are read by one asyncio task per worker: no thread
waits on any worker. How it supervises and lends threads: ``docs/design.md``; how versions
come and go: ``docs/models.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from app.batching import BatchItem, WorkerStatus
from app.errors import (
    InferenceError,
    ModelLoadFailed,
    ModelVersionUnavailable,
    WorkerDied,
    WorkerStartError,
)
from app.jobs import BatchKey, ImageJob
from app.metrics import BatchRun
from app.plan import ServingPlan, WorkerConfig
from app.repository import ModelSpec
from app.workers.backoff import RestartBackoff
from app.workers.handle import Reply, WorkerCrashed, WorkerHandle
from app.workers.idle import IdleWorkers
from app.workers.lending import batch_threads
from app.workers.messages import BatchDone, LoadDone, LoadModel, ModelLoaded, RunBatch, UnloadModel
from app.workers.transfer import results, write_images

log = logging.getLogger(__name__)

# Room for each encoded upload in a worker's buffer when the workers decode (the buffer holds
# at least a batch of pixels anyway); a batch of bigger uploads sends the rest inline.
ENCODED_BYTES_PER_IMAGE = 128 * 1024
# The buffer holds a full batch of at least this image, so a model loaded later with images
# up to this size batches as fully as the ones loaded at start.
COMMON_IMAGE_SHAPE = (224, 224, 3)


def _retrieve(future: asyncio.Future[Reply]) -> None:
    """Read a reply nobody awaits, so that a failure in it is not reported as lost."""
    if not future.cancelled():
        future.exception()


def buffer_bytes(config: WorkerConfig, image_shapes: Sequence[tuple[int, int, int]]) -> int:
    """A worker's shared buffer: a full batch of pixels of the largest model's images (at
    least ``COMMON_IMAGE_SHAPE``), or of typical encoded uploads when the workers decode."""
    per_image = max(int(np.prod(shape)) for shape in [COMMON_IMAGE_SHAPE, *image_shapes])
    if config.decode_threads:
        per_image = max(per_image, ENCODED_BYTES_PER_IMAGE)
    return config.max_batch_size * per_image


class WorkerPool:
    """One worker process per device of ``plan.placement``, one batch each at a time, each
    holding every model of ``models`` (and of later ``load`` calls).

    It supervises them: a worker that dies (or hangs on a batch past the plan's batch timeout
    and is killed) fails its in-flight batch with ``WorkerDied`` at once and is restarted with
    capped exponential backoff, with the models the pool serves then, while the others keep
    serving. ``on_run`` hears of every batch a worker ran (``app.metrics.BatchRun``).

    >>> # pool = WorkerPool([spec], plan_serving(settings))
    >>> # await pool.start()
    >>> # results = await pool.run_batch(BatchKey(Task.TAG, False, spec.served_id), items)
    >>> # await pool.load(new_spec)       # one worker at a time; ModelLoadFailed if it fails
    >>> # await pool.unload(spec.served_id)
    >>> # await pool.aclose()
    """

    def __init__(
        self,
        models: Sequence[ModelSpec],
        plan: ServingPlan,
        *,
        on_run: Callable[[BatchRun], None] | None = None,
    ) -> None:
        self.placement = plan.placement
        self.config: WorkerConfig = plan.worker
        self.start_timeout_s = plan.limits.start_timeout_s
        self.batch_timeout_s = plan.limits.batch_timeout_s
        self._on_run = on_run
        # The models every worker holds (and a restarted one loads), by served id.
        self._models: dict[str, ModelSpec] = {spec.served_id: spec for spec in models}
        self._buffer_size = buffer_bytes(self.config, [spec.image_shape for spec in models])
        self._workers: list[WorkerHandle] = []
        # Last in, first out: at low load the worker that just answered takes the next batch,
        # its caches and OpenMP threads still warm; under load every worker is busy anyway.
        self._idle: IdleWorkers[WorkerHandle] = IdleWorkers()
        self._holds: dict[int, asyncio.Future[None]] = {}  # worker index -> its hold, waiting
        self._control = asyncio.Lock()  # one load or unload at a time
        self._batch_ids = itertools.count()
        self._restarts: dict[int, asyncio.Task[None]] = {}
        self._backoff = RestartBackoff()
        self._closing = False
        self._restarted = [0] * len(self.placement.devices)  # by worker slot

    # -- the Transport's state ---------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """How many batches may run at once (one per worker)."""
        return len(self.placement.devices)

    @property
    def batch_size(self) -> int:
        """The largest batch any model takes."""
        sizes = [self._model_batch_size(served_id, False) for served_id in self._models]
        return max(sizes, default=self.config.max_batch_size)

    def batch_size_for(self, key: Hashable) -> int:
        """The largest batch of ``key``'s model: the smallest its workers want (with
        ``MB_BATCH_SIZE=auto``, their choices), within what their buffers hold."""
        assert isinstance(key, BatchKey)
        return self._model_batch_size(key.model, key.encoded)

    def _model_batch_size(self, served_id: str, encoded: bool) -> int:
        wanted = [w.models[served_id].batch_size for w in self._workers if w.holds(served_id)]
        size = min(wanted) if wanted else self.config.max_batch_size
        spec = self._models.get(served_id)
        if spec is not None and not encoded:  # a batch of pixels must fit the buffer
            size = min(size, max(1, self._buffer_size // int(np.prod(spec.image_shape))))
        return size

    @property
    def ready(self) -> bool:
        """True while at least one worker is loaded and alive (it can serve requests)."""
        return any(w.ready and w.alive for w in self._workers)

    @property
    def shared_queue_depth(self) -> int:
        return 0  # every request waits in this process's Streamer

    @property
    def workers(self) -> Sequence[WorkerHandle]:
        return tuple(self._workers)

    @property
    def models(self) -> Mapping[str, ModelSpec]:
        """The models every worker holds, by served id."""
        return dict(self._models)

    def worker_status(self) -> list[WorkerStatus]:
        return [worker.status(self._restarted[worker.index]) for worker in self._workers]

    # -- lifecycle ---------------------------------------------------------------------------

    def _spawn(self, index: int) -> WorkerHandle:
        device, threads = self.placement.devices[index], self.placement.threads
        models = tuple(self._models.values())
        return WorkerHandle.spawn(index, device, threads, self.config, self._buffer_size, models)

    async def start(self) -> None:
        """Spawn every worker and wait until each has loaded and warmed up its models."""
        self._workers = [self._spawn(index) for index in range(len(self.placement.devices))]
        try:
            await asyncio.wait_for(
                asyncio.gather(*(self._wait_ready(w.index) for w in self._workers)),
                self.start_timeout_s,
            )
        except TimeoutError:
            await self.aclose()
            raise WorkerStartError(
                f"workers did not load within MB_WORKER_START_TIMEOUT={self.start_timeout_s:g} s"
            ) from None
        except BaseException:
            await self.aclose()
            raise
        for worker in self._workers:
            worker.start_reading(self._on_idle, self._on_exit)
        log.info(
            "%d worker(s) ready: %s",
            len(self._workers),
            ", ".join(f"{w.device} ({w.threads} threads)" for w in self._workers),
        )

    async def _wait_ready(self, index: int) -> WorkerHandle:
        """Wait until worker ``index`` is ready, and return it. Under ``MB_RUNTIME=auto`` a
        worker that crashes while it loads and self-tests the runtimes (native code that
        aborts on this host, which no self-test can catch in-process) is started again with
        TorchScript alone, and so is every later start of this pool."""
        worker = self._workers[index]
        try:
            await worker.wait_ready()
        except WorkerCrashed as exc:
            if self.config.runtime != "auto":
                raise
            log.error(
                "worker %d on %s crashed while loading its runtimes (%s); a runtime other than "
                "TorchScript may crash on this host: this pool serves with TorchScript only",
                index,
                worker.device,
                exc,
            )
            self.config = dataclasses.replace(self.config, runtime="torchscript")
            await worker.stop(0.0, "crashed during start-up")
            worker = self._workers[index] = self._spawn(index)
            await worker.wait_ready()
        if self.config.auto_batch:
            for model in worker.models.values():
                measured = ", ".join(
                    f"{size}: {rate:.1f}" for size, rate in model.throughput.items()
                )
                log.info(
                    "worker %d on %s: MB_BATCH_SIZE=auto chose %d for %s (images/s by batch "
                    "size: %s)",
                    worker.index,
                    worker.device,
                    model.batch_size,
                    model.served_id,
                    measured,
                )
        return worker

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Stop every worker (politely, then by force) and release its buffer."""
        self._closing = True
        for task in self._restarts.values():
            task.cancel()
        await asyncio.gather(*self._restarts.values(), return_exceptions=True)
        for worker in self._workers:
            worker.ask_to_stop()
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            await worker.stop(deadline - time.monotonic(), "worker pool is shutting down")
        self._workers.clear()
        self._idle.wake_all()

    # -- models coming and going -------------------------------------------------------------

    async def load(self, spec: ModelSpec) -> list[ModelLoaded]:
        """Load ``spec`` beside the models held, on one worker at a time (the others serve
        meanwhile), and add it to what every worker holds from now on; each worker's report.
        If it fails anywhere (a bad file, a failed self-test, over ``MB_MODEL_MEMORY``, a
        worker that dies or hangs), the workers that loaded it drop it again and
        ``ModelLoadFailed`` says why: the models served before are untouched."""
        image_bytes = int(np.prod(spec.image_shape))
        if image_bytes > self._buffer_size:
            raise ModelLoadFailed(
                f"one {'x'.join(map(str, spec.image_shape))} image takes {image_bytes} bytes; the "
                f"workers' buffers hold {self._buffer_size} (sized at start for the models then "
                "and MB_BATCH_SIZE): start the server with this model in the repository",
                "load",
            )
        async with self._control:
            if spec.served_id in self._models:
                return [w.models[spec.served_id] for w in self._workers if w.holds(spec.served_id)]
            loaded: list[WorkerHandle] = []
            reports: list[ModelLoaded] = []
            try:
                for worker in list(self._workers):
                    if not (worker.alive and worker.ready):
                        continue  # restarting: it catches up once it is back (_catch_up)
                    reply = await self._ask(worker, LoadModel(next(self._batch_ids), spec))
                    assert isinstance(reply, LoadDone)
                    loaded.append(worker)
                    reports.append(reply.model)
                if not reports:
                    raise ModelLoadFailed("no model worker is running to load it", "load")
            except BaseException:
                for worker in loaded:
                    with contextlib.suppress(Exception):
                        await self._ask(worker, UnloadModel(next(self._batch_ids), spec.served_id))
                raise
            self._models[spec.served_id] = spec
            return reports

    async def unload(self, served_id: str) -> None:
        """Drop a model from every worker (its memory goes back to the kernel) and from what
        a restarted worker loads. The caller has let its requests finish."""
        async with self._control:
            self._models.pop(served_id, None)
            for worker in list(self._workers):
                if worker.holds(served_id):  # one that fails (dies) restarts without it
                    with contextlib.suppress(WorkerDied, ModelLoadFailed):
                        await self._ask(worker, UnloadModel(next(self._batch_ids), served_id))
            self._idle.wake_all()  # a batch still waiting for it sees none holds it

    async def _ask(self, worker: WorkerHandle, message: LoadModel | UnloadModel) -> Reply:
        """Send a load or unload to ``worker`` once it is idle, taking it out of the batch
        rotation until it answers; a worker that dies or passes the start timeout meanwhile
        fails the load (it restarts with the models served before)."""
        what = "loading" if isinstance(message, LoadModel) else "unloading"
        await self._hold(worker)
        if not worker.alive:
            raise ModelLoadFailed(
                f"worker {worker.index} died before {what} the model", "worker crash"
            )
        future = worker.send(message)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.start_timeout_s)
        except WorkerDied:
            raise ModelLoadFailed(
                f"worker {worker.index} died while {what} the model", "worker crash"
            ) from None
        except TimeoutError:
            log.error(
                "worker %d spent over MB_WORKER_START_TIMEOUT=%g s %s a model: killing it",
                worker.index,
                self.start_timeout_s,
                what,
            )
            worker.kill()
            future.add_done_callback(_retrieve)
            raise ModelLoadFailed(
                f"worker {worker.index} took over {self.start_timeout_s:g} s {what} the model",
                "timeout",
            ) from None

    async def _hold(self, worker: WorkerHandle) -> None:
        """Take ``worker`` out of the batch rotation once its batch (if any) is answered."""
        held = self._holds[worker.index] = asyncio.get_running_loop().create_future()
        try:
            while not held.done():
                # Idle already, or put back idle by a caller that gave up the worker it was
                # handed (which skips _on_idle): take it from there.
                if self._idle.take(worker):
                    return
                if not worker.alive:
                    raise WorkerDied(f"model worker {worker.index} died")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(held), 0.5)
            held.result()
        finally:
            if self._holds.get(worker.index) is held:
                del self._holds[worker.index]

    async def _catch_up(self, worker: WorkerHandle) -> None:
        """A restarted worker loads what was loaded while it was down, and drops what was
        unloaded, before it serves those models."""
        async with self._control:
            if not worker.alive:
                return
            for served_id in set(worker.models) - set(self._models):
                await self._ask(worker, UnloadModel(next(self._batch_ids), served_id))
            for served_id, spec in self._models.items():
                if served_id not in worker.models:
                    await self._ask(worker, LoadModel(next(self._batch_ids), spec))

    # -- running batches ---------------------------------------------------------------------

    async def run_batch(
        self, key: Hashable, items: Sequence[BatchItem[ImageJob]]
    ) -> Mapping[int, Any]:
        """Run one batch of same-key items on an idle worker holding its model; results
        keyed by item id."""
        assert isinstance(key, BatchKey)
        if len(items) > self.config.max_batch_size:
            raise ValueError(
                f"batch of {len(items)} exceeds max_batch_size {self.config.max_batch_size}"
            )
        if key.encoded and not self.placement.decode.workers_decode:
            raise TypeError("the workers do not decode: submit decoded images (pixels)")
        spec = self._models.get(key.model)
        if spec is None:
            raise ModelVersionUnavailable(f"the workers hold no model {key.model!r}")
        worker = await self._acquire(key.model)
        ids = tuple(item.id for item in items)
        top_ks = [item.payload.top_k for item in items]
        try:
            spans, inline = write_images(
                worker.buffer, [item.payload.image for item in items], spec.image_shape
            )
        except BaseException:  # nothing was sent: the worker is idle still
            self._on_idle(worker)
            raise
        threads = batch_threads(worker, self._workers, time.monotonic())
        batch_id = next(self._batch_ids)
        message = RunBatch(
            batch_id, key.task, ids, max(top_ks, default=0), spans, inline, threads, key.model
        )
        future = worker.send(message)
        reply = await self._wait_reply(worker, future, len(items))
        assert isinstance(reply, BatchDone)
        if self._on_run is not None:
            run = BatchRun(
                key.task.value, len(items), reply.compute_s, reply.threads, worker.index, key.model
            )
            self._on_run(run)
        if reply.ids != ids:
            raise InferenceError(f"worker answered batch {batch_id} for other items")
        if reply.model != key.model:
            raise InferenceError(f"worker ran batch {batch_id} on {reply.model}, not {key.model}")
        return results(key.task, top_ks, ids, reply.outputs, reply.errors)

    async def _wait_reply(
        self, worker: WorkerHandle, future: asyncio.Future[Reply], size: int
    ) -> Reply:
        # shield: the worker keeps computing if the caller goes away, and only its reply (or
        # its death) may hand it back.
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.batch_timeout_s)
        except asyncio.CancelledError:  # every caller left: the reply still frees the worker
            future.add_done_callback(_retrieve)
            raise
        except TimeoutError:
            log.error(
                "worker %d spent over MB_BATCH_TIMEOUT=%g s on a batch of %d: killing it",
                worker.index,
                self.batch_timeout_s,
                size,
            )
            worker.kill()
            return await asyncio.wait_for(future, 10)  # its death fails the future

    async def _acquire(self, served_id: str) -> WorkerHandle:
        while True:
            if not self.ready:
                raise WorkerDied("no model worker is running; one is restarting", retry_after_s=2)
            if not any(w.holds(served_id) for w in self._workers):
                raise WorkerDied(f"no running worker holds {served_id}", retry_after_s=2)
            idle: WorkerHandle | None = await self._idle.get(lambda w: w.holds(served_id))
            if idle is not None and idle.alive and idle in self._workers:
                return idle

    def _on_idle(self, worker: WorkerHandle) -> None:
        if worker.batches:  # it has answered a batch: it works, reset its restart backoff
            self._backoff.reset(worker.index)
        held = self._holds.pop(worker.index, None)
        if held is not None and not held.done():
            held.set_result(None)  # a load or unload takes it before any batch does
            return
        self._idle.put(worker)

    # -- supervision -------------------------------------------------------------------------

    def _on_exit(self, worker: WorkerHandle) -> None:
        if not worker.alive:
            return
        self._idle.take(worker)
        held = self._holds.pop(worker.index, None)
        if held is not None and not held.done():
            held.set_exception(WorkerDied(f"model worker {worker.index} died"))
        if self._closing:  # it was told to stop: an ordinary exit
            worker.mark_dead("worker pool is shutting down")
            return
        worker.process.join(timeout=0.1)
        log.error(
            "worker %d on %s died (exit code %s)",
            worker.index,
            worker.device,
            worker.process.exitcode,
        )
        worker.mark_dead(f"model worker {worker.index} died")
        # Wake everyone waiting for an idle worker so they see whether any is left.
        self._idle.wake_all()
        self._restarts[worker.index] = asyncio.create_task(
            self._restart(worker), name=f"restart-{worker.index}"
        )

    async def _restart(self, dead: WorkerHandle) -> None:
        index = dead.index
        try:
            await dead.stop(0.0, f"model worker {index} died")
            while not self._closing:
                delay = self._backoff.next_delay(index)
                log.warning("restarting worker %d on %s in %.1f s", index, dead.device, delay)
                await asyncio.sleep(delay)
                self._workers[index] = self._spawn(index)
                try:
                    worker = await asyncio.wait_for(self._wait_ready(index), self.start_timeout_s)
                except (WorkerStartError, TimeoutError) as exc:
                    log.error("worker %d failed to restart: %s", index, exc)
                    worker = self._workers[index]
                    worker.kill()
                    await worker.stop(1.0, "restart failed")
                    continue
                worker.start_reading(self._on_idle, self._on_exit)
                self._restarted[index] += 1
                log.info(
                    "worker %d on %s restarted (pid %s)", index, dead.device, worker.process.pid
                )
                try:  # under the lock: after any load or unload that ran meanwhile
                    await self._catch_up(worker)
                except (ModelLoadFailed, WorkerDied) as exc:
                    log.error("worker %d could not catch up on the models: %s", index, exc)
                    worker.kill()
                return
        finally:
            if self._restarts.get(index) is asyncio.current_task():
                del self._restarts[index]
