"""The worker pool: model worker processes on this machine, as a ``Transport``.

It fills ``app.batching.Transport``: ``start``/``aclose``, ``run_batch`` (the Streamer's
batch function), ``capacity``, ``batch_size``, ``ready`` and ``worker_status()``; its
``models`` (``app.workers.hosting.PoolHost``) load, hold and drain the model versions each
worker holds, which it carries out (``load_on``, ``unload_on``); and it keeps its workers
running (``app.workers.supervision``). Replies are read by one asyncio task per worker: no
thread waits on any worker. How it supervises and lends threads: ``docs/design.md``; how
versions come and go: ``docs/models.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, cast

import numpy as np

from app import tracing
from app.batching import BatchItem, QueueBacklog, WorkerStatus
from app.errors import InferenceError, ModelLoadFailed, WorkerDied, WorkerStartError
from app.jobs import BatchKey, ImageJob
from app.lifecycle import ModelSpec
from app.metrics import BatchRun
from app.plan import ServingPlan, WorkerConfig
from app.workers.choices import HostChoices
from app.workers.handle import Reply, WorkerHandle, retrieve
from app.workers.hands import LoadObserver, PoolWorker
from app.workers.hosting import PoolHost
from app.workers.idle import IdleWorkers
from app.workers.lending import batch_threads
from app.workers.messages import (
    BatchDone,
    LoadDone,
    LoadModel,
    ModelLoaded,
    RunBatch,
    UnloadModel,
)
from app.workers.supervision import Supervision
from app.workers.transfer import results, write_images

log = logging.getLogger(__name__)

# Room for each encoded upload in a worker's buffer when the workers decode (the buffer holds
# at least a batch of pixels anyway); a batch of bigger uploads sends the rest inline.
ENCODED_BYTES_PER_IMAGE = 128 * 1024
# The buffer holds a full batch of at least this image, so a model loaded later with images
# up to this size batches as fully as the ones loaded at start.
COMMON_IMAGE_SHAPE = (224, 224, 3)
# A worker that neither loads nor says it gave up (at MB_WORKER_START_TIMEOUT) within this
# much more is stuck: it is killed, and restarts.
STUCK_S = 30.0


class LoadFroze(ModelLoadFailed):
    """A load that froze its worker, which the pool killed: a worker crash (step), but a
    kill, never a native crash that would say a runtime is unsafe here (no wait for its
    exit code on the event loop)."""


def buffer_bytes(config: WorkerConfig, image_shapes: Sequence[tuple[int, int, int]]) -> int:
    """A worker's shared buffer: a full batch of pixels of the largest model's images (at
    least ``COMMON_IMAGE_SHAPE``), or of typical encoded uploads when the workers decode."""
    per_image = max(int(np.prod(shape)) for shape in [COMMON_IMAGE_SHAPE, *image_shapes])
    if config.decode_threads:
        per_image = max(per_image, ENCODED_BYTES_PER_IMAGE)
    return config.max_batch_size * per_image


class WorkerPool:
    """One worker process per device of ``plan.placement``, one batch each at a time. Its
    host (``models``) has each worker load the versions of the model repository it is
    attached to: at start (start-up is a load) and whenever asked.

    A worker that dies (or hangs on a batch past the plan's batch timeout and is killed)
    fails its in-flight batch with ``WorkerDied`` at once and is restarted with capped
    exponential backoff, then loads what it should hold, while the others keep serving.
    ``on_run`` hears of every batch a worker ran (``app.metrics.BatchRun``), ``on_load`` of
    every load on a worker. ``models``: the versions it will serve first, whose images its
    workers' buffers are sized for.

    >>> # pool = WorkerPool(specs, plan_serving(settings))
    >>> # pool.models.attach(repository, "auto", on_view=..., in_use=...)
    >>> # await pool.start()           # every worker loads its names' targets
    >>> # results = await pool.run_batch(BatchKey(Task.TAG, False, served_id), items)
    >>> # await pool.models.pin("tagger", 3)   # one worker at a time, then the name moves
    >>> # await pool.aclose()
    """

    def __init__(
        self,
        models: Sequence[ModelSpec],
        plan: ServingPlan,
        *,
        on_run: Callable[[BatchRun], None] | None = None,
        on_load: LoadObserver | None = None,
    ) -> None:
        self.placement = plan.placement
        self.config: WorkerConfig = plan.worker
        self.start_timeout_s = plan.limits.start_timeout_s
        self.batch_timeout_s = plan.limits.batch_timeout_s
        self._on_run = on_run
        self._workers: list[WorkerHandle] = []
        # Last in, first out: at low load the worker that just answered takes the next batch,
        # its caches and OpenMP threads still warm; under load every worker is busy anyway.
        self._idle: IdleWorkers[WorkerHandle] = IdleWorkers()
        self._batch_ids = itertools.count()  # batches, loads and unloads: one counter
        # Loads whose worker died while it also ran a batch, once each (``ask``).
        self._interrupted: set[tuple[str, int]] = set()
        self.buffer_size = buffer_bytes(self.config, [spec.image_shape for spec in models])
        self.host = PoolHost(
            self, choices=HostChoices(plan.worker.state_dir), min_workers=None, on_load=on_load
        )
        self.supervision = Supervision(self)
        self._closing = False

    # -- the Transport's state ---------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """How many batches may run at once (one per worker)."""
        return len(self.placement.devices)

    @property
    def batch_size(self) -> int:
        """The largest batch any model takes."""
        sizes = [self._model_batch_size(served_id, False) for served_id in self.host.held_ids()]
        return max(sizes, default=self.config.max_batch_size)

    def batch_size_for(self, key: Hashable) -> int:
        """The largest batch of ``key``'s model: the smallest its workers want (with
        ``MB_BATCH_SIZE=auto``, their choices), within what their buffers hold."""
        assert isinstance(key, BatchKey)
        return self._model_batch_size(key.model, key.encoded)

    def _model_batch_size(self, served_id: str, encoded: bool) -> int:
        wanted = [w.models[served_id].batch_size for w in self._workers if w.holds(served_id)]
        size = min(wanted) if wanted else self.config.max_batch_size
        spec = self.host.spec_of(served_id)
        if spec is not None and not encoded:  # a batch of pixels must fit the buffer
            per_image = int(np.prod(spec.image_shape))
            size = min(size, max(1, self.buffer_size // per_image))
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

    def worker_status(self) -> list[WorkerStatus]:
        held = {int(k.name.rsplit(" ", 1)[-1]): k.held() for k in self.host.keepers.values()}
        return [
            w.status(self.supervision.restarted[w.index], held.get(w.index, ()))
            for w in self._workers
        ]

    async def backlog(self) -> QueueBacklog | None:
        return None  # every request waits in this process's Streamer

    async def refresh(self) -> None:
        """Nothing to look at: the pool knows its workers as they change."""

    @property
    def models(self) -> PoolHost:
        """Its host: the versions each worker holds (``app.batching.VersionControl``)."""
        return self.host

    # -- what its host has the workers do ----------------------------------------------------

    def host_workers(self) -> Sequence[WorkerHandle]:
        return tuple(self._workers)

    async def load_on(self, worker: PoolWorker, spec: ModelSpec) -> ModelLoaded:
        """Load ``spec`` on ``worker`` beside the models it holds (it goes on with its
        batches meanwhile); its report. ``ModelLoadFailed`` (or ``ModelMemoryBudget``) says
        why not: what it held before is untouched."""
        worker = cast(WorkerHandle, worker)  # its host has only this pool's
        image_bytes = int(np.prod(spec.image_shape))
        if image_bytes > self.buffer_size:
            raise ModelLoadFailed(
                f"one {'x'.join(map(str, spec.image_shape))} image takes {image_bytes} bytes; the "
                f"workers' buffers hold {self.buffer_size} (sized at start for the models then "
                "and MB_BATCH_SIZE): start the server with this model in the repository",
                "load",
            )
        delay_s = 0.0 if self.host.starting else self.config.load_delay_for(worker.index)
        message = LoadModel(next(self._batch_ids), spec, self.start_timeout_s, delay_s)
        try:
            reply = await self.ask(worker, message)
        except ModelLoadFailed as exc:
            crashed = exc.step == "worker crash" and not isinstance(exc, LoadFroze)
            if crashed and self.supervision.load_crashed(worker):
                exc.step = "runtime crash"
            raise
        assert isinstance(reply, LoadDone)
        report = reply.model
        if self.config.auto_batch:
            measured = ", ".join(f"{size}: {rate:.1f}" for size, rate in report.throughput.items())
            log.info(
                "worker %d on %s: MB_BATCH_SIZE=auto chose %d for %s (images/s by batch size: "
                "%s)",
                worker.index, worker.device, report.batch_size, report.served_id, measured,
            )  # fmt: skip
        return report

    async def unload_on(self, worker: PoolWorker, served_id: str) -> None:
        """Drop ``served_id`` from ``worker`` (its memory goes back to the kernel); batches
        still waiting for it then see that no worker holds it."""
        worker = cast(WorkerHandle, worker)
        if worker.alive and served_id in worker.models:
            with contextlib.suppress(WorkerDied, ModelLoadFailed):
                await self.ask(worker, UnloadModel(next(self._batch_ids), served_id))
        self._idle.wake_all()

    async def ask(self, worker: WorkerHandle, message: LoadModel | UnloadModel) -> Reply:
        """Send a load or an unload to ``worker`` (it goes on with its batches); a worker
        that dies meanwhile fails it, and one that neither answers nor gives up by the load
        deadline (and ``STUCK_S`` more) is killed (it restarts)."""
        what = "loading" if isinstance(message, LoadModel) else "unloading"
        if not worker.alive or worker.killed_for:  # the load never ran: not its fault
            raise ModelLoadFailed(
                f"worker {worker.index} died before {what} the model", "interrupted"
            )
        future = worker.send(message)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.start_timeout_s + STUCK_S)
        except WorkerDied:
            if worker.killed_for:  # the pool ended it for something else: its restart loads
                raise ModelLoadFailed(
                    f"worker {worker.index} was killed while {what} the model "
                    f"({worker.killed_for})",
                    "interrupted",
                ) from None
            loading = message.spec if isinstance(message, LoadModel) else None
            key = (loading.name, loading.version) if loading is not None else None
            if worker.died_running and key is not None and key not in self._interrupted:
                # A batch beside the load may have crashed it (a poison input): tried once
                # more by its restart, then (dying again) given up as a crash.
                self._interrupted.add(key)
                raise ModelLoadFailed(
                    f"worker {worker.index} died while {what} the model and running a batch",
                    "interrupted",
                ) from None
            raise ModelLoadFailed(
                f"worker {worker.index} died while {what} the model", "worker crash"
            ) from None
        except TimeoutError:
            log.error("worker %d is stuck %s a model: killing it", worker.index, what)
            worker.kill()
            future.add_done_callback(retrieve)
            # The load froze its worker: it killed it as a crash would (not tried again by
            # its restart, nor on the others, until an explicit retry).
            raise LoadFroze(
                f"worker {worker.index} froze {what} the model (no answer in "
                f"{self.start_timeout_s + STUCK_S:g} s): killed",
                "worker crash",
            ) from None

    # -- lifecycle ---------------------------------------------------------------------------

    def _spawn(self, index: int) -> WorkerHandle:
        device, threads = self.placement.devices[index], self.placement.threads
        return WorkerHandle.spawn(index, device, threads, self.config, self.buffer_size)

    async def start(self) -> None:
        """Spawn every worker, wait until each is ready, then have each load its names'
        targets (``PoolHost.start``): ``WorkerStartError`` saying why if that fails."""
        count = len(self.placement.devices)
        try:
            async with asyncio.timeout(self.start_timeout_s):
                self._workers = []
                for index in range(count):  # each kept as it starts: a failure stops them
                    self._workers.append(self._spawn(index))
                await asyncio.gather(*(self.supervision.wait_ready(i) for i in range(count)))
            for worker in self._workers:
                self.serve(worker)
            await self.host.start(self.start_timeout_s)
        except TimeoutError:
            await self.aclose()
            raise WorkerStartError(
                f"workers did not start within MB_WORKER_START_TIMEOUT={self.start_timeout_s:g} s"
            ) from None
        except BaseException:
            await self.aclose()
            raise
        log.info(
            "%d worker(s) ready: %s",
            len(self._workers),
            ", ".join(f"{w.device} ({w.threads} threads)" for w in self._workers),
        )

    def serve(self, worker: WorkerHandle) -> None:
        """Route ``worker``'s replies from now on, and put it in the batch rotation."""
        worker.start_reading(self._on_idle, self.supervision.on_exit)

    def replace(self, index: int) -> WorkerHandle:
        """Spawn a new worker in slot ``index`` (its last one died)."""
        worker = self._workers[index] = self._spawn(index)
        return worker

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Stop every worker (politely, then by force) and release its buffer."""
        self._closing = True
        await self.host.aclose()
        await self.supervision.aclose()
        for worker in self._workers:
            worker.ask_to_stop()
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            await worker.stop(deadline - time.monotonic(), "worker pool is shutting down")
        self._workers.clear()
        self._idle.wake_all()

    @property
    def closing(self) -> bool:
        return self._closing

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
        spec = self.host.spec_of(key.model)
        if spec is None:  # admitted for it, so it served: the worker holding it died
            raise WorkerDied(
                f"no running worker holds {key.model}; a worker restarts with it",
                retry_after_s=2,
            )
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
            batch_id,
            key.task,
            ids,
            max(top_ks, default=0),
            spans,
            inline,
            threads,
            key.model,
            tracing.carried(items),
        )
        future = worker.send(message)
        reply = await self._wait_reply(worker, batch_id, future, len(items))
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
        self, worker: WorkerHandle, batch_id: int, future: asyncio.Future[Reply], size: int
    ) -> Reply:
        # Awaited straight (no shield, no wait_for: one hand-over instead of three). If every
        # caller leaves, the future is cancelled and the worker computes on: only its reply
        # (or its death) hands it back. Past MB_BATCH_TIMEOUT it is killed, and its death
        # fails the future: so the timer stays armed while the worker still runs the batch,
        # whether anyone waits for it or not.
        timer = asyncio.get_running_loop().call_later(
            self.batch_timeout_s, self._hung, worker, batch_id, size
        )
        try:
            return await future
        finally:
            if not worker.running(batch_id):
                timer.cancel()

    def _hung(self, worker: WorkerHandle, batch_id: int, size: int) -> None:
        if not worker.running(batch_id):  # it answered after its callers left
            return
        log.error(
            "worker %d spent over MB_BATCH_TIMEOUT=%g s on a batch of %d: killing it",
            worker.index,
            self.batch_timeout_s,
            size,
        )
        worker.kill(f"a batch past MB_BATCH_TIMEOUT={self.batch_timeout_s:g} s")

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
        if worker.killed_for:  # its answer came as it was killed: it takes no more
            return
        if worker.batches:  # it has answered a batch: it works, reset its restart backoff
            self.supervision.backoff.reset(worker.index)
        self._idle.put(worker)

    def forget(self, worker: WorkerHandle) -> None:
        """``worker`` died: out of the rotation, and everyone waiting for an idle worker
        looks again whether any is left."""
        self._idle.take(worker)
        self._idle.wake_all()
