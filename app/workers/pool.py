"""The worker pool: model worker processes on this machine, as a ``Transport``.

It fills ``app.batching.Transport``: ``start``/``aclose``, ``run_batch`` (the Streamer's
batch function), ``capacity``, ``batch_size``, ``ready`` and ``worker_status()``; it hosts
the models the registry asks for (``load``/``unload``: ``app.workers.hosting``), and keeps
its workers running (``app.workers.supervision``). Replies are read by one asyncio task per
worker: no thread waits on any worker. How it supervises and lends threads:
``docs/design.md``; how versions come and go: ``docs/models.md``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from app import tracing
from app.batching import BatchItem, QueueBacklog, WorkerStatus
from app.errors import InferenceError, ModelVersionUnavailable, WorkerDied, WorkerStartError
from app.jobs import BatchKey, ImageJob
from app.lifecycle import ModelSpec
from app.manifest import split_served_id
from app.metrics import BatchRun
from app.plan import ServingPlan, WorkerConfig
from app.workers.handle import Reply, WorkerHandle, retrieve
from app.workers.hosting import PoolModels
from app.workers.idle import IdleWorkers
from app.workers.lending import batch_threads
from app.workers.messages import BatchDone, ModelLoaded, RunBatch
from app.workers.supervision import Supervision
from app.workers.transfer import results, write_images

log = logging.getLogger(__name__)

# Room for each encoded upload in a worker's buffer when the workers decode (the buffer holds
# at least a batch of pixels anyway); a batch of bigger uploads sends the rest inline.
ENCODED_BYTES_PER_IMAGE = 128 * 1024
# The buffer holds a full batch of at least this image, so a model loaded later with images
# up to this size batches as fully as the ones loaded at start.
COMMON_IMAGE_SHAPE = (224, 224, 3)


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

    A worker that dies (or hangs on a batch past the plan's batch timeout and is killed)
    fails its in-flight batch with ``WorkerDied`` at once and is restarted with capped
    exponential backoff, with the models the pool serves then, while the others keep
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
        self._workers: list[WorkerHandle] = []
        # Last in, first out: at low load the worker that just answered takes the next batch,
        # its caches and OpenMP threads still warm; under load every worker is busy anyway.
        self._idle: IdleWorkers[WorkerHandle] = IdleWorkers()
        self._batch_ids = itertools.count()
        buffer = buffer_bytes(self.config, [spec.image_shape for spec in models])
        self.hosting = PoolModels(
            models, lambda: self._workers, self.config, buffer, self._batch_ids,
            self.start_timeout_s,
        )  # fmt: skip
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
        sizes = [self._model_batch_size(served_id, False) for served_id in self.hosting.specs]
        return max(sizes, default=self.config.max_batch_size)

    def batch_size_for(self, key: Hashable) -> int:
        """The largest batch of ``key``'s model: the smallest its workers want (with
        ``MB_BATCH_SIZE=auto``, their choices), within what their buffers hold."""
        assert isinstance(key, BatchKey)
        return self._model_batch_size(key.model, key.encoded)

    def _model_batch_size(self, served_id: str, encoded: bool) -> int:
        wanted = [w.models[served_id].batch_size for w in self._workers if w.holds(served_id)]
        size = min(wanted) if wanted else self.config.max_batch_size
        spec = self.hosting.specs.get(served_id)
        if spec is not None and not encoded:  # a batch of pixels must fit the buffer
            per_image = int(np.prod(spec.image_shape))
            size = min(size, max(1, self.hosting.buffer_size // per_image))
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
        return dict(self.hosting.specs)

    def worker_status(self) -> list[WorkerStatus]:
        return [w.status(self.supervision.restarted[w.index]) for w in self._workers]

    async def backlog(self) -> QueueBacklog | None:
        return None  # every request waits in this process's Streamer

    async def refresh(self) -> None:
        """Nothing to look at: the pool knows its workers as they change."""

    @property
    def models_host(self) -> WorkerPool:
        return self  # this process tells its workers what to load

    @property
    def models_control(self) -> None:
        return None

    async def load(self, spec: ModelSpec) -> list[ModelLoaded]:
        """``app.workers.hosting.PoolModels.load``."""
        return await self.hosting.load(spec)

    async def unload(self, served_id: str) -> None:
        """``app.workers.hosting.PoolModels.unload``; batches still waiting for the model
        then see that no worker holds it."""
        await self.hosting.unload(served_id)
        self._idle.wake_all()

    # -- lifecycle ---------------------------------------------------------------------------

    def _spawn(self, index: int) -> WorkerHandle:
        device, threads = self.placement.devices[index], self.placement.threads
        models = tuple(self.hosting.specs.values())
        return WorkerHandle.spawn(
            index, device, threads, self.config, self.hosting.buffer_size, models
        )

    async def start(self) -> None:
        """Spawn every worker and wait until each has loaded and warmed up its models. Under
        ``MB_DTYPE=auto`` the first worker chooses each export's precision, then the others
        start in it (one id per export on a host)."""
        count = len(self.placement.devices)
        deciding = any(spec.dtype == "auto" for spec in self.hosting.specs.values())
        try:
            async with asyncio.timeout(self.start_timeout_s):
                if deciding:
                    self._workers = [self._spawn(0)]
                    first = await self.supervision.wait_ready(0)
                    self._adopt(first)
                self._workers += [self._spawn(i) for i in range(len(self._workers), count)]
                await asyncio.gather(
                    *(self.supervision.wait_ready(w.index) for w in self._workers[deciding:])
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
            self.serve(worker)
        log.info(
            "%d worker(s) ready: %s",
            len(self._workers),
            ", ".join(f"{w.device} ({w.threads} threads)" for w in self._workers),
        )

    def _adopt(self, first: WorkerHandle) -> None:
        """The specs as the first worker loaded them: in the precision it chose."""
        reports = {split_served_id(m.served_id)[0]: m for m in first.models.values()}
        specs = [
            self.hosting.learn(spec, reports[split_served_id(spec.served_id)[0]])
            for spec in self.hosting.specs.values()
        ]
        self.hosting.specs = {spec.served_id: spec for spec in specs}

    def decided(self, spec: ModelSpec) -> ModelSpec:
        """``spec`` in the precision this host's workers serve its export in (once one
        chose it): its id in answers."""
        return self.hosting.decided(spec)

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
        spec = self.hosting.specs.get(key.model)
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
            future.add_done_callback(retrieve)
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
            self.supervision.backoff.reset(worker.index)
        self._idle.put(worker)

    def forget(self, worker: WorkerHandle) -> None:
        """``worker`` died: out of the rotation, and everyone waiting for an idle worker
        looks again whether any is left."""
        self._idle.take(worker)
        self._idle.wake_all()
