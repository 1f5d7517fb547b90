"""The worker pool: spawns model workers and is the Streamer's batch function.

This is the transport between the Streamer and the workers. Its whole public surface is
``start``/``aclose``, ``capacity``, ``ready`` and ``run_batch`` (the Streamer's ``BatchFn``),
so another transport (a broker shared by many front ends, say) can stand in its place.

Replies are read by one asyncio task per worker (``Channel``): no thread waits on any worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np

from app.batching import BatchItem
from app.errors import (
    InferenceError,
    InvalidImage,
    PayloadTooLarge,
    ServerError,
    UnsupportedImageFormat,
    WorkerDied,
    WorkerStartError,
)
from app.jobs import ImageJob, Task, TopK
from app.manifest import Manifest
from app.workers.devices import assign_workers, cuda_device_count, resolve_devices
from app.workers.process import worker_main
from app.workers.protocol import (
    STOP,
    BatchDone,
    BatchFailed,
    Channel,
    InputBuffer,
    Ready,
    RunBatch,
    StartFailed,
    WorkerSpec,
    channel_pair,
)

log = logging.getLogger(__name__)

# Room for each encoded upload in a worker's buffer when the workers decode (the buffer holds
# at least a batch of pixels anyway); a batch of bigger uploads sends the rest inline.
ENCODED_BYTES_PER_IMAGE = 128 * 1024
# A CPU worker lends its threads only once it has sat idle this long: at low load, idle
# workers stay idle. Under load they are idle only between two batches, and a borrowed
# thread would soon be fighting its own worker's next batch for the core: OpenMP waits at
# every barrier for its slowest thread, so a batch that borrows under load can stall.
LEND_AFTER_IDLE_S = 0.05
# The errors a worker may report for one image, by class name.
_IMAGE_ERRORS: dict[str, type[ServerError]] = {
    cls.__name__: cls for cls in (InvalidImage, UnsupportedImageFormat, PayloadTooLarge)
}


@dataclass(eq=False)
class _Worker:
    spec: WorkerSpec
    process: BaseProcess
    conn: Channel
    buffer: InputBuffer
    reader: asyncio.Task[None] | None = None
    ready: bool = False
    alive: bool = True
    pending: asyncio.Future[BatchDone] | None = None
    pending_id: int | None = None
    batch_size: int = 0
    throughput: dict[int, float] = field(default_factory=dict)
    batches: int = 0
    items: int = 0
    idle_since: float = 0.0  # monotonic time it last became idle


@dataclass
class PoolStats:
    """What the workers actually ran: ``batch_sizes[task][n]`` counts model calls of n items."""

    batch_sizes: dict[str, dict[int, int]] = field(default_factory=dict)
    threads: dict[int, int] = field(default_factory=dict)  # batches by torch threads used

    def record(self, task: str, size: int) -> None:
        sizes = self.batch_sizes.setdefault(task, {})
        sizes[size] = sizes.get(size, 0) + 1

    def record_threads(self, threads: int) -> None:
        self.threads[threads] = self.threads.get(threads, 0) + 1


def _image_error(name: str, message: str) -> ServerError:
    """The typed error for an image a worker could not decode (its 4xx), or a plain
    inference error for anything else (logged by the worker)."""
    error = _IMAGE_ERRORS.get(name)
    return error(message) if error is not None else InferenceError("could not decode the image")


async def _wait_for_exit(process: BaseProcess, timeout_s: float) -> None:
    """Wait (without a thread) until ``process`` exits or ``timeout_s`` passes."""
    if not process.is_alive() or timeout_s <= 0:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    exited = asyncio.Event()
    loop.add_reader(process.sentinel, exited.set)
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(exited.wait(), timeout_s)
    finally:
        loop.remove_reader(process.sentinel)
    # The sentinel closes while the process exits, a moment before it can be reaped: a big
    # process (a worker with its models) can still count as alive for some milliseconds.
    # Nothing signals the reaping itself, so poll.
    while process.is_alive() and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.005)


class WorkerPool:
    """``MB_WORKER_NUM`` worker processes spread over the devices, one batch each at a time.

    It supervises them: a worker that dies (or hangs on a batch past ``batch_timeout_s`` and
    is killed) fails its in-flight batch with ``WorkerDied`` at once and is restarted with
    capped exponential backoff, while the others keep serving.
    """

    RESTART_BACKOFF_S = (0.5, 30.0)  # first delay, cap

    def __init__(
        self,
        *,
        model_store: Path,
        manifest: Manifest,
        devices: list[int] | None,
        worker_num: int | None,
        threads_per_worker: int | None,
        max_batch_size: int,
        start_timeout_s: float,
        batch_timeout_s: float = 60.0,
        auto_batch: bool = False,
        decode: str = "server",
        decode_threads: int | None = None,
        max_pixels: int = 40_000_000,
        dtype: str = "float32",
        optimize: bool = True,
        on_compute: Callable[[str, int, float], None] | None = None,
    ) -> None:
        self.model_store = model_store
        self.manifest = manifest
        self._requested_devices = devices
        self._worker_num = worker_num
        self._threads = threads_per_worker
        self.max_batch_size = max_batch_size
        self.start_timeout_s = start_timeout_s
        self.batch_timeout_s = batch_timeout_s
        self.auto_batch = auto_batch
        self._decode = decode
        self._decode_threads = decode_threads
        self.max_pixels = max_pixels
        self.dtype = dtype
        self.optimize = optimize
        self._on_compute = on_compute  # (task, batch size, seconds in the worker) per batch
        size = manifest.input.crop_size
        self.image_shape = (size, size, 3)
        self.devices: list[str] = []
        self._workers: list[_Worker] = []
        # Last in, first out: at low load the worker that just answered takes the next batch,
        # its caches and OpenMP threads still warm; under load every worker is busy anyway.
        self._idle: asyncio.LifoQueue[_Worker] = asyncio.LifoQueue()
        self._batch_ids = itertools.count()
        self._restarts: dict[int, asyncio.Task[None]] = {}
        self._failures: dict[int, int] = {}
        self._closing = False
        self.restart_count = 0
        self.stats = PoolStats()

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """How many batches may run at once (one per worker)."""
        return len(self.assigned_devices())

    def assigned_devices(self) -> list[str]:
        if not self.devices:
            available = cuda_device_count()
            try:
                self.devices = resolve_devices(self._requested_devices, available)
            except ValueError as exc:
                raise WorkerStartError(str(exc)) from None
            if self._requested_devices and available == 0:
                log.warning(
                    "CUDA_DEVICES=%s but no CUDA device is usable: running on CPU",
                    ",".join(map(str, self._requested_devices)),
                )
        return assign_workers(self.devices, self._worker_num)

    @functools.cached_property
    def decode_in_workers(self) -> bool:
        """Whether uploads travel encoded and the workers decode them (``MB_DECODE``):
        ``auto`` means yes as soon as one worker runs on a GPU. Fixed for the pool's life."""
        if self._decode == "auto":
            return any(device != "cpu" for device in self.assigned_devices())
        return self._decode in ("worker", "device")

    @functools.cached_property
    def workers_can_decode(self) -> bool:
        """Whether the workers have a decoder: when they decode every batch, and with ``auto``
        on CPU workers, where the server decodes but an upload that reaches an idle server
        may travel encoded (see ``Predictor``)."""
        return self.decode_in_workers or self._decode == "auto"

    def _threads_for(self, device: str, workers: int) -> int:
        if self._threads is not None:
            return self._threads
        if device == "cpu":
            return max(1, (os.cpu_count() or 1) // workers)
        return 1  # a GPU worker's CPU threads only feed the device

    def _decode_threads_for(self, device: str, workers: int) -> int:
        if not self.workers_can_decode:
            return 0
        if self._decode_threads is not None:
            return self._decode_threads
        if device == "cpu":  # the model's threads idle while the batch decodes
            return self._threads_for(device, workers)
        return max(1, (os.cpu_count() or 1) // workers)  # a GPU worker's cores decode

    def _spawn(self, index: int, device: str, workers: int) -> _Worker:
        per_image = int(np.prod(self.image_shape))
        if self.workers_can_decode:
            per_image = max(per_image, ENCODED_BYTES_PER_IMAGE)
        buffer = InputBuffer.create(self.max_batch_size * per_image)
        spec = WorkerSpec(
            index=index,
            device=device,
            threads=self._threads_for(device, workers),
            model_store=str(self.model_store),
            buffer_path=buffer.path,
            buffer_size=buffer.size,
            max_batch_size=self.max_batch_size,
            image_shape=self.image_shape,
            auto_batch=self.auto_batch,
            dtype=self.dtype,
            optimize=self.optimize,
            decode_threads=self._decode_threads_for(device, workers),
            decode_on_device=self._decode == "device",
            max_pixels=self.max_pixels,
        )
        context = mp.get_context("spawn")
        parent, child = channel_pair()
        process = context.Process(
            target=worker_main, args=(spec, child), name=f"model-worker-{index}", daemon=True
        )
        try:
            process.start()
        except BaseException:
            buffer.unlink()
            buffer.close()
            raise
        child.close()  # so the parent sees EOF the moment the worker dies
        return _Worker(spec, process, parent, buffer)

    async def start(self) -> None:
        """Spawn every worker and wait until each has loaded and warmed up its models."""
        assigned = self.assigned_devices()
        self._workers = [self._spawn(i, device, len(assigned)) for i, device in enumerate(assigned)]
        try:
            await asyncio.wait_for(
                asyncio.gather(*(self._await_ready(w) for w in self._workers)),
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
            self._activate(worker)
        log.info(
            "%d worker(s) ready: %s",
            len(self._workers),
            ", ".join(f"{w.spec.device} ({w.spec.threads} threads)" for w in self._workers),
        )

    async def _await_ready(self, worker: _Worker) -> None:
        try:
            await worker.conn.open()
            message = await worker.conn.recv()
        except (asyncio.IncompleteReadError, OSError):
            await _wait_for_exit(worker.process, 1.0)
            raise WorkerStartError(
                f"worker {worker.spec.index} on {worker.spec.device} exited during start-up "
                f"(exit code {worker.process.exitcode})"
            ) from None
        if isinstance(message, StartFailed):
            raise WorkerStartError(
                f"worker {message.index} on {worker.spec.device} failed to start: {message.message}"
            )
        assert isinstance(message, Ready)
        worker.ready = True
        worker.batch_size, worker.throughput = message.batch_size, message.throughput
        if self.auto_batch:
            measured = ", ".join(f"{size}: {rate:.1f}" for size, rate in message.throughput.items())
            log.info(
                "worker %d on %s: MB_BATCH_SIZE=auto chose %d (images/s by batch size: %s)",
                worker.spec.index,
                worker.spec.device,
                message.batch_size,
                measured,
            )

    def _activate(self, worker: _Worker) -> None:
        worker.buffer.unlink()  # both sides have it mapped; nothing to leak from now on
        worker.reader = asyncio.create_task(
            self._read_replies(worker), name=f"worker-{worker.spec.index}-replies"
        )
        self._make_idle(worker)

    def _make_idle(self, worker: _Worker) -> None:
        """Hand ``worker`` to the next batch, noting since when it idles (see lending)."""
        worker.idle_since = time.monotonic()
        self._idle.put_nowait(worker)

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Stop every worker (politely, then by force) and release its buffer."""
        self._closing = True
        for task in self._restarts.values():
            task.cancel()
        await asyncio.gather(*self._restarts.values(), return_exceptions=True)
        for worker in self._workers:
            if worker.alive:
                with contextlib.suppress(OSError, ValueError, AssertionError, RuntimeError):
                    worker.conn.send(STOP)
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            await self._stop(worker, deadline - time.monotonic(), "worker pool is shutting down")
        self._workers.clear()

    async def _stop(self, worker: _Worker, timeout_s: float, reason: str) -> None:
        await _wait_for_exit(worker.process, timeout_s)
        if worker.process.is_alive():
            log.warning("worker %d did not stop in time; killing it", worker.spec.index)
            worker.process.kill()
            await _wait_for_exit(worker.process, 5.0)
        worker.process.join(timeout=1)
        self._mark_dead(worker, reason)
        worker.conn.close()
        worker.buffer.unlink()
        worker.buffer.close()

    # -- state -------------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """The batch size to form: the maximum, or with auto the smallest worker's choice."""
        chosen = [w.batch_size for w in self._workers if w.ready]
        return min(chosen) if chosen else self.max_batch_size

    @property
    def ready(self) -> bool:
        """True while at least one worker is loaded and alive (it can serve requests)."""
        return any(w.ready and w.alive for w in self._workers)

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "index": w.spec.index,
                "device": w.spec.device,
                "threads": w.spec.threads,
                "pid": w.process.pid,
                "ready": w.ready,
                "alive": w.alive,
                "batch_size": w.batch_size,
                "batches": w.batches,
                "items": w.items,
            }
            for w in self._workers
        ]

    # -- running batches ---------------------------------------------------------------------

    async def run_batch(
        self, key: Hashable, items: Sequence[BatchItem[ImageJob]]
    ) -> Mapping[int, Any]:
        """Run one batch of same-task items on an idle worker; results keyed by item id."""
        task = Task(key)  # type: ignore[arg-type]
        if len(items) > self.max_batch_size:
            raise ValueError(f"batch of {len(items)} exceeds max_batch_size {self.max_batch_size}")
        worker = await self._acquire()
        ids = tuple(item.id for item in items)
        top_k = max((item.payload.top_k for item in items), default=0)
        batch_id = next(self._batch_ids)
        threads = self._batch_threads(worker)
        message = self._write_batch(worker.buffer, batch_id, task, ids, top_k, threads, items)
        future: asyncio.Future[BatchDone] = asyncio.get_running_loop().create_future()
        worker.pending, worker.pending_id = future, batch_id
        worker.batches += 1
        worker.items += len(items)
        self.stats.record(task.value, len(items))
        try:
            worker.conn.send(message)
        except (OSError, RuntimeError):  # transport already closed: the worker is gone
            self._on_death(worker)
        # shield: the worker keeps computing if the caller goes away, and only its reply (or
        # its death) may hand it back.
        try:
            reply = await asyncio.wait_for(asyncio.shield(future), self.batch_timeout_s)
        except TimeoutError:
            log.error(
                "worker %d spent over MB_BATCH_TIMEOUT=%g s on a batch of %d: killing it",
                worker.spec.index,
                self.batch_timeout_s,
                len(items),
            )
            worker.process.kill()
            reply = await asyncio.wait_for(future, 10)  # its death fails the future
        self.stats.record_threads(reply.threads)
        if self._on_compute is not None:
            self._on_compute(task.value, len(items), reply.compute_s)
        if reply.ids != ids:
            raise InferenceError(f"worker answered batch {batch_id} for other items")
        failed = {items[pos].id: _image_error(*error) for pos, error in reply.errors.items()}
        computed = [item for position, item in enumerate(items) if position not in reply.errors]
        return {**self._split(task, computed, reply.outputs), **failed}

    def _batch_threads(self, worker: _Worker) -> int:
        """A CPU worker's own threads, plus those of every other CPU worker that has sat idle
        for ``LEND_AFTER_IDLE_S``: a lone request gets all the cores, and under load (when
        workers are idle only between batches) each keeps its share, so no two OpenMP teams
        fight over a core."""
        if worker.spec.device != "cpu":
            return 0
        idle_before = time.monotonic() - LEND_AFTER_IDLE_S
        idle = [
            other
            for other in self._workers
            if other is not worker
            and other.spec.device == "cpu"
            and other.alive
            and other.ready
            and other.pending is None
            and other.idle_since <= idle_before
        ]
        return worker.spec.threads + sum(other.spec.threads for other in idle)

    def _write_batch(
        self,
        buffer: InputBuffer,
        batch_id: int,
        task: Task,
        ids: tuple[int, ...],
        top_k: int,
        threads: int,
        items: Sequence[BatchItem[ImageJob]],
    ) -> RunBatch:
        """Put the batch's images into the worker's buffer; the message that runs it.

        Decoded images go in as pixel rows, each at its place in the batch. Encoded uploads
        are packed end to end: from the start when the whole batch is encoded, else after the
        pixel rows (a batch can mix both with ``auto`` on CPU workers)."""
        images = [item.payload.image for item in items]
        blobs = [image for image in images if isinstance(image, bytes)]
        if blobs and not self.workers_can_decode:
            raise TypeError("the workers do not decode: submit decoded images (pixels)")
        if len(blobs) == len(images):
            spans, inline = buffer.pack(blobs)
            return RunBatch(batch_id, task, ids, top_k, spans, inline, threads)
        pixels = buffer.images(len(images), self.image_shape)
        for row, image in enumerate(images):
            if not isinstance(image, bytes):
                pixels[row] = image
        if not blobs:
            return RunBatch(batch_id, task, ids, top_k, threads=threads)
        packed = iter(zip(*buffer.pack(blobs, start=pixels.nbytes), strict=True))
        rows = [next(packed) if isinstance(image, bytes) else (None, None) for image in images]
        spans, inline = (tuple(column) for column in zip(*rows, strict=True))
        return RunBatch(batch_id, task, ids, top_k, spans, inline, threads)

    @staticmethod
    def _split(
        task: Task, items: Sequence[BatchItem[ImageJob]], outputs: dict[str, Any]
    ) -> dict[int, Any]:
        if not items:
            return {}
        if task is Task.EMBEDDING:
            embedding = outputs["embedding"]
            if len(embedding) != len(items):
                raise InferenceError(f"{len(embedding)} embeddings for {len(items)} images")
            return {item.id: embedding[row] for row, item in enumerate(items)}
        indices, probs = outputs["indices"], outputs["probs"]
        if len(indices) != len(items) or len(probs) != len(items):
            raise InferenceError(f"{len(indices)} tag rows for {len(items)} images")
        return {
            item.id: TopK(indices[row, : item.payload.top_k], probs[row, : item.payload.top_k])
            for row, item in enumerate(items)
        }

    async def _acquire(self) -> _Worker:
        while True:
            if not self.ready:
                raise WorkerDied("no model worker is running; one is restarting", retry_after_s=2)
            worker = await self._idle.get()
            if worker.alive and worker in self._workers:
                return worker

    async def _read_replies(self, worker: _Worker) -> None:
        while True:
            try:
                message = await worker.conn.recv()
            except (asyncio.IncompleteReadError, OSError) as exc:
                log.debug("worker %d channel closed: %r", worker.spec.index, exc)
                self._on_death(worker)
                return
            self._on_reply(worker, message)

    def _on_reply(self, worker: _Worker, message: object) -> None:
        future, expected = worker.pending, worker.pending_id
        if not isinstance(message, BatchDone | BatchFailed) or message.batch_id != expected:
            log.error("worker %d sent an unexpected message %r", worker.spec.index, message)
            return
        worker.pending = worker.pending_id = None
        self._make_idle(worker)
        self._failures.pop(worker.spec.index, None)  # it works: reset its restart backoff
        if future is None or future.done():
            return
        if isinstance(message, BatchFailed):
            # The full message (it may hold paths) goes to the log, not to HTTP clients.
            log.error("worker %d: batch failed: %s", worker.spec.index, message.message)
            future.set_exception(InferenceError("model call failed"))
        else:
            future.set_result(message)

    def _on_death(self, worker: _Worker) -> None:
        if not worker.alive:
            return
        if self._closing:  # it was told to stop: an ordinary exit
            self._mark_dead(worker, "worker pool is shutting down")
            return
        worker.process.join(timeout=0.1)
        log.error(
            "worker %d on %s died (exit code %s)",
            worker.spec.index,
            worker.spec.device,
            worker.process.exitcode,
        )
        self._mark_dead(worker, f"model worker {worker.spec.index} died")
        # Wake everyone waiting for an idle worker (at most one per worker) so they see that
        # none is left; _acquire skips dead entries.
        if not self.ready:
            for _ in self._workers:
                self._idle.put_nowait(worker)
        if not self._closing:
            index = worker.spec.index
            self._restarts[index] = asyncio.create_task(
                self._restart(worker), name=f"restart-{index}"
            )

    async def _restart(self, dead: _Worker) -> None:
        index = dead.spec.index
        try:
            await self._stop(dead, 0.0, f"model worker {index} died")
            while not self._closing:
                failures = self._failures.get(index, 0)
                first, cap = self.RESTART_BACKOFF_S
                delay = min(cap, first * 2**failures)
                self._failures[index] = failures + 1
                log.warning("restarting worker %d on %s in %.1f s", index, dead.spec.device, delay)
                await asyncio.sleep(delay)
                worker = self._spawn(index, dead.spec.device, len(self._workers))
                self._workers[index] = worker
                try:
                    await asyncio.wait_for(self._await_ready(worker), self.start_timeout_s)
                except (WorkerStartError, TimeoutError) as exc:
                    log.error("worker %d failed to restart: %s", index, exc)
                    worker.process.kill()
                    await self._stop(worker, 1.0, "restart failed")
                    continue
                self._activate(worker)
                self.restart_count += 1
                log.info(
                    "worker %d on %s restarted (pid %s)",
                    index,
                    dead.spec.device,
                    worker.process.pid,
                )
                return
        finally:
            self._restarts.pop(index, None)

    def _mark_dead(self, worker: _Worker, reason: str) -> None:
        if worker.alive:
            worker.alive = False
            reader = worker.reader
            if reader is not None and reader is not asyncio.current_task():
                reader.cancel()
        future, worker.pending = worker.pending, None
        if future is not None and not future.done():
            future.set_exception(WorkerDied(reason))
