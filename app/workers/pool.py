"""The worker pool: model worker processes on this machine, as a ``Transport``.

It fills ``app.batching.Transport``: ``start``/``aclose``, ``run_batch`` (the Streamer's
batch function), ``capacity``, ``batch_size``, ``ready`` and ``worker_status()``. Replies
are read by one asyncio task per worker: no thread waits on any worker. How it supervises
and lends threads: ``docs/design.md``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from app.batching import BatchItem, WorkerStatus
from app.errors import InferenceError, WorkerDied, WorkerStartError
from app.jobs import BatchKey, ImageJob
from app.manifest import Manifest
from app.metrics import BatchRun
from app.plan import ServingPlan, WorkerConfig
from app.workers.backoff import RestartBackoff
from app.workers.handle import WorkerCrashed, WorkerHandle
from app.workers.lending import batch_threads
from app.workers.messages import BatchDone, RunBatch
from app.workers.transfer import results, write_images

log = logging.getLogger(__name__)

# Room for each encoded upload in a worker's buffer when the workers decode (the buffer holds
# at least a batch of pixels anyway); a batch of bigger uploads sends the rest inline.
ENCODED_BYTES_PER_IMAGE = 128 * 1024


def _retrieve(future: asyncio.Future[BatchDone]) -> None:
    """Read a reply nobody awaits, so that a failure in it is not reported as lost."""
    if not future.cancelled():
        future.exception()


def buffer_bytes(config: WorkerConfig, image_shape: tuple[int, int, int]) -> int:
    """A worker's shared buffer: a full batch of pixels, or of typical encoded uploads when
    the workers decode."""
    per_image = int(np.prod(image_shape))
    if config.decode_threads:
        per_image = max(per_image, ENCODED_BYTES_PER_IMAGE)
    return config.max_batch_size * per_image


class WorkerPool:
    """One worker process per device of ``plan.placement``, one batch each at a time.

    It supervises them: a worker that dies (or hangs on a batch past the plan's batch timeout
    and is killed) fails its in-flight batch with ``WorkerDied`` at once and is restarted with
    capped exponential backoff, while the others keep serving. ``on_run`` hears of every
    batch a worker ran (``app.metrics.BatchRun``).

    >>> # pool = WorkerPool(manifest, plan_serving(settings))
    >>> # await pool.start()
    >>> # results = await pool.run_batch(BatchKey(Task.TAG, encoded=False), items)
    >>> # await pool.aclose()
    """

    def __init__(
        self,
        manifest: Manifest,
        plan: ServingPlan,
        *,
        on_run: Callable[[BatchRun], None] | None = None,
    ) -> None:
        self.manifest = manifest
        self.placement = plan.placement
        self.config: WorkerConfig = plan.worker
        self.start_timeout_s = plan.limits.start_timeout_s
        self.batch_timeout_s = plan.limits.batch_timeout_s
        self._on_run = on_run
        self.image_shape = manifest.input.image_shape
        self._buffer_size = buffer_bytes(self.config, self.image_shape)
        self._workers: list[WorkerHandle] = []
        # Last in, first out: at low load the worker that just answered takes the next batch,
        # its caches and OpenMP threads still warm; under load every worker is busy anyway.
        self._idle: asyncio.LifoQueue[WorkerHandle] = asyncio.LifoQueue()
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
        """The batch size to form: the maximum, or with auto the smallest worker's choice."""
        chosen = [w.batch_size for w in self._workers if w.ready]
        return min(chosen) if chosen else self.config.max_batch_size

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
        return [worker.status(self._restarted[worker.index]) for worker in self._workers]

    # -- lifecycle ---------------------------------------------------------------------------

    def _spawn(self, index: int) -> WorkerHandle:
        device, threads = self.placement.devices[index], self.placement.threads
        return WorkerHandle.spawn(index, device, threads, self.config, self._buffer_size)

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
            measured = ", ".join(f"{size}: {rate:.1f}" for size, rate in worker.throughput.items())
            log.info(
                "worker %d on %s: MB_BATCH_SIZE=auto chose %d (images/s by batch size: %s)",
                worker.index,
                worker.device,
                worker.batch_size,
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

    # -- running batches ---------------------------------------------------------------------

    async def run_batch(
        self, key: Hashable, items: Sequence[BatchItem[ImageJob]]
    ) -> Mapping[int, Any]:
        """Run one batch of same-key items on an idle worker; results keyed by item id."""
        assert isinstance(key, BatchKey)
        if len(items) > self.config.max_batch_size:
            raise ValueError(
                f"batch of {len(items)} exceeds max_batch_size {self.config.max_batch_size}"
            )
        if key.encoded and not self.placement.decode.workers_decode:
            raise TypeError("the workers do not decode: submit decoded images (pixels)")
        worker = await self._acquire()
        ids = tuple(item.id for item in items)
        top_ks = [item.payload.top_k for item in items]
        spans, inline = write_images(
            worker.buffer, [item.payload.image for item in items], self.image_shape
        )
        threads = batch_threads(worker, self._workers, time.monotonic())
        batch_id = next(self._batch_ids)
        message = RunBatch(batch_id, key.task, ids, max(top_ks, default=0), spans, inline, threads)
        future = worker.send(message)
        reply = await self._wait_reply(worker, future, len(items))
        if self._on_run is not None:
            run = BatchRun(key.task.value, len(items), reply.compute_s, reply.threads, worker.index)
            self._on_run(run)
        if reply.ids != ids:
            raise InferenceError(f"worker answered batch {batch_id} for other items")
        return results(key.task, top_ks, ids, reply.outputs, reply.errors)

    async def _wait_reply(
        self, worker: WorkerHandle, future: asyncio.Future[BatchDone], size: int
    ) -> BatchDone:
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

    async def _acquire(self) -> WorkerHandle:
        while True:
            if not self.ready:
                raise WorkerDied("no model worker is running; one is restarting", retry_after_s=2)
            worker = await self._idle.get()
            if worker.alive and worker in self._workers:
                return worker

    def _on_idle(self, worker: WorkerHandle) -> None:
        if worker.batches:  # it has answered a batch: it works, reset its restart backoff
            self._backoff.reset(worker.index)
        self._idle.put_nowait(worker)

    # -- supervision -------------------------------------------------------------------------

    def _on_exit(self, worker: WorkerHandle) -> None:
        if not worker.alive:
            return
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
        # Wake everyone waiting for an idle worker (at most one per worker) so they see that
        # none is left; _acquire skips dead entries.
        if not self.ready:
            for _ in self._workers:
                self._idle.put_nowait(worker)
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
                return
        finally:
            self._restarts.pop(index, None)
