"""The worker pool: spawns model workers and is the Streamer's batch function.

This is the transport between the Streamer and the workers. Its whole public surface is
``start``/``aclose``, ``capacity``, ``ready`` and ``run_batch`` (the Streamer's ``BatchFn``),
so another transport (a broker shared by many front ends, say) can stand in its place.

Replies are read on the event loop with ``add_reader``: no thread waits on any worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from app.batching import BatchItem
from app.errors import InferenceError, WorkerDied, WorkerStartError
from app.jobs import ImageJob, Task, TopK
from app.manifest import Manifest
from app.workers.devices import assign_workers, cuda_device_count, resolve_devices
from app.workers.process import worker_main
from app.workers.protocol import (
    STOP,
    BatchDone,
    BatchFailed,
    InputBuffer,
    Ready,
    RunBatch,
    StartFailed,
    WorkerSpec,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Worker:
    spec: WorkerSpec
    process: BaseProcess
    conn: Connection
    buffer: InputBuffer
    ready: bool = False
    alive: bool = True
    pending: asyncio.Future[BatchDone] | None = None
    pending_id: int | None = None
    batches: int = 0


@dataclass
class PoolStats:
    """What the workers actually ran: ``batch_sizes[task][n]`` counts model calls of n items."""

    batch_sizes: dict[str, dict[int, int]] = field(default_factory=dict)

    def record(self, task: str, size: int) -> None:
        sizes = self.batch_sizes.setdefault(task, {})
        sizes[size] = sizes.get(size, 0) + 1


async def _wait_for_exit(process: BaseProcess, timeout_s: float) -> None:
    """Wait (without a thread) until ``process`` exits or ``timeout_s`` passes."""
    if not process.is_alive() or timeout_s <= 0:
        return
    loop = asyncio.get_running_loop()
    exited = asyncio.Event()
    loop.add_reader(process.sentinel, exited.set)
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(exited.wait(), timeout_s)
    finally:
        loop.remove_reader(process.sentinel)


class WorkerPool:
    """``MB_WORKER_NUM`` worker processes spread over the devices, one batch each at a time."""

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
    ) -> None:
        self.model_store = model_store
        self.manifest = manifest
        self._requested_devices = devices
        self._worker_num = worker_num
        self._threads = threads_per_worker
        self.max_batch_size = max_batch_size
        self.start_timeout_s = start_timeout_s
        size = manifest.input.crop_size
        self.image_shape = (size, size, 3)
        self.devices: list[str] = []
        self._workers: list[_Worker] = []
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._batch_ids = itertools.count()
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

    def _threads_for(self, device: str, workers: int) -> int:
        if self._threads is not None:
            return self._threads
        if device == "cpu":
            return max(1, (os.cpu_count() or 1) // workers)
        return 1  # a GPU worker's CPU threads only feed the device

    async def start(self) -> None:
        """Spawn every worker and wait until each has loaded and warmed up its models."""
        assigned = self.assigned_devices()
        context = mp.get_context("spawn")
        loop = asyncio.get_running_loop()
        for index, device in enumerate(assigned):
            buffer = InputBuffer.create(self.max_batch_size, self.image_shape)
            spec = WorkerSpec(
                index=index,
                device=device,
                threads=self._threads_for(device, len(assigned)),
                model_store=str(self.model_store),
                buffer_path=buffer.path,
                max_batch_size=self.max_batch_size,
                image_shape=self.image_shape,
            )
            parent, child = context.Pipe(duplex=True)
            process = context.Process(
                target=worker_main, args=(spec, child), name=f"model-worker-{index}", daemon=True
            )
            process.start()
            child.close()  # so the parent sees EOF the moment the worker dies
            self._workers.append(_Worker(spec, process, parent, buffer))
        try:
            await asyncio.wait_for(
                asyncio.gather(*(self._await_ready(w, loop) for w in self._workers)),
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
            worker.buffer.unlink()  # both sides have it mapped; nothing to leak from now on
            loop.add_reader(worker.conn.fileno(), self._on_readable, worker)
            self._idle.put_nowait(worker)
        log.info(
            "%d worker(s) ready: %s",
            len(self._workers),
            ", ".join(f"{w.spec.device} ({w.spec.threads} threads)" for w in self._workers),
        )

    async def _await_ready(self, worker: _Worker, loop: asyncio.AbstractEventLoop) -> None:
        readable = asyncio.Event()
        loop.add_reader(worker.conn.fileno(), readable.set)
        try:
            await readable.wait()
        finally:
            loop.remove_reader(worker.conn.fileno())
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(timeout=1)
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

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Stop every worker (politely, then by force) and release its buffer."""
        loop = asyncio.get_running_loop()
        for worker in self._workers:
            if worker.alive:
                try:
                    loop.remove_reader(worker.conn.fileno())
                    worker.conn.send(STOP)
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            await _wait_for_exit(worker.process, deadline - time.monotonic())
            if worker.process.is_alive():
                log.warning("worker %d did not stop in time; killing it", worker.spec.index)
                worker.process.kill()
            worker.process.join(timeout=5)
            self._mark_dead(worker, "worker pool is shutting down")
            worker.conn.close()
            worker.buffer.unlink()
            worker.buffer.close()
        self._workers.clear()

    # -- state -------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """True when every worker is loaded and alive."""
        return bool(self._workers) and all(w.ready and w.alive for w in self._workers)

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "index": w.spec.index,
                "device": w.spec.device,
                "threads": w.spec.threads,
                "pid": w.process.pid,
                "ready": w.ready,
                "alive": w.alive,
                "batches": w.batches,
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
        for row, item in enumerate(items):
            worker.buffer.array[row] = item.payload.pixels
        batch_id = next(self._batch_ids)
        future: asyncio.Future[BatchDone] = asyncio.get_running_loop().create_future()
        worker.pending, worker.pending_id = future, batch_id
        try:
            worker.conn.send(RunBatch(batch_id, task, ids, top_k))
        except OSError:
            self._on_death(worker)
        worker.batches += 1
        self.stats.record(task.value, len(items))
        # Not cancelled with the caller: the worker keeps computing, and only its reply may
        # hand it back to the idle queue.
        reply = await asyncio.shield(future)
        if reply.ids != ids:
            raise InferenceError(f"worker answered batch {batch_id} for other items")
        return self._split(task, items, reply.outputs)

    @staticmethod
    def _split(
        task: Task, items: Sequence[BatchItem[ImageJob]], outputs: dict[str, Any]
    ) -> dict[int, Any]:
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
            if not any(w.alive for w in self._workers):
                raise WorkerDied("no model worker is running", retry_after_s=5)
            worker = await self._idle.get()
            if worker.alive:
                return worker

    def _on_readable(self, worker: _Worker) -> None:
        try:
            while worker.conn.poll():
                message = worker.conn.recv()
                self._on_reply(worker, message)
        except (EOFError, OSError):
            self._on_death(worker)

    def _on_reply(self, worker: _Worker, message: object) -> None:
        future, expected = worker.pending, worker.pending_id
        if not isinstance(message, BatchDone | BatchFailed) or message.batch_id != expected:
            log.error("worker %d sent an unexpected message %r", worker.spec.index, message)
            return
        worker.pending = worker.pending_id = None
        self._idle.put_nowait(worker)
        if future is None or future.done():
            return
        if isinstance(message, BatchFailed):
            future.set_exception(InferenceError(f"model call failed: {message.message}"))
        else:
            future.set_result(message)

    def _on_death(self, worker: _Worker) -> None:
        if not worker.alive:
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
        if not any(w.alive for w in self._workers):
            for _ in self._workers:
                self._idle.put_nowait(worker)

    def _mark_dead(self, worker: _Worker, reason: str) -> None:
        if worker.alive:
            worker.alive = False
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(worker.conn.fileno())
        future, worker.pending = worker.pending, None
        if future is not None and not future.done():
            future.set_exception(WorkerDied(reason))
