"""One worker process, as the pool sees it: start it, wait until it is ready, send it a
batch, route its reply, stop or kill it, and release its buffer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

from app.batching import HeldModel, WorkerStatus
from app.errors import (
    DiedRunning,
    InferenceError,
    ModelLoadFailed,
    ModelMemoryBudget,
    WorkerDied,
    WorkerStartError,
)
from app.lifecycle import HeldView, ModelSpec, VersionState
from app.plan import WorkerConfig
from app.workers import allocator
from app.workers.buffer import InputBuffer
from app.workers.channel import Channel, channel_pair
from app.workers.lineage import die_with_parent
from app.workers.messages import (
    STOP,
    BatchDone,
    BatchFailed,
    LoadDone,
    LoadFailed,
    LoadModel,
    ModelLoaded,
    ModelUnloaded,
    Ready,
    RunBatch,
    StartFailed,
    UnloadModel,
    WorkerSpec,
)

# What a worker answers to one request: a batch's results, a model loaded or unloaded.
Reply = BatchDone | LoadDone | ModelUnloaded

log = logging.getLogger("app.workers.pool")


def _said(version: HeldView) -> str:
    """Why a version failed (its step, then the reason) or drains."""
    return f"{version.step}: {version.reason}" if version.step else version.reason


def retrieve(future: asyncio.Future[Reply]) -> None:
    """Read a reply nobody awaits, so that a failure in it is not reported as lost."""
    if not future.cancelled():
        future.exception()


def _worker_entry(spec: WorkerSpec, conn: Connection) -> None:
    """The worker process's target: it dies with the pool's process (killed, even with
    ``-9``); torch is imported there, never in the pool's process."""
    die_with_parent(spec.parent_pid)
    from app.workers.serve import worker_main

    worker_main(spec, conn)


PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def rss_bytes(pid: int | None) -> int | None:
    """A process's resident memory (Linux's /proc), or None where it cannot be read."""
    if pid is None:
        return None
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * PAGE_BYTES


def cpu_seconds(pid: int | None) -> float | None:
    """A process's CPU time, user and system (Linux's /proc), or None where it cannot be
    read."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    except (OSError, ValueError, IndexError):
        return None
    return ticks / CLOCK_TICKS


async def wait_for_exit(process: BaseProcess, timeout_s: float) -> None:
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


class WorkerCrashed(WorkerStartError):
    """A worker process exited during its start-up without reporting why (a signal: native
    code crashed, or the kernel killed it), as opposed to reporting a failure."""


class WorkerHandle:
    """A spawned worker process, its socket and its shared buffer.

    >>> # handle = WorkerHandle.spawn(0, "cpu", 2, config, buffer_size)
    >>> # await handle.wait_ready()       # WorkerStartError if it cannot load
    >>> # handle.start_reading(on_idle=pool_put_back, on_exit=pool_on_death)
    >>> # reply = await handle.send(message)  # a BatchDone; WorkerDied if it dies meanwhile
    >>> # await handle.stop(timeout_s=10)
    """

    def __init__(
        self, spec: WorkerSpec, process: BaseProcess, conn: Channel, buffer: InputBuffer
    ) -> None:
        self.spec = spec
        self.process = process
        self.conn = conn
        self.buffer = buffer
        self.ready = False
        self.alive = True
        self.models: dict[str, ModelLoaded] = {}  # by served id, once it is ready
        self.loading: ModelSpec | None = None  # what it is loading now
        self.killed_for: str | None = None  # why the pool killed it (it dies any moment)
        self.died_running = False  # it died of itself while it ran a batch
        self.batches = 0
        self.items = 0
        self.idle_since = 0.0  # monotonic time it last became idle (see app.workers.lending)
        self._reader: asyncio.Task[None] | None = None
        self._on_idle: Callable[[WorkerHandle], None] = lambda _: None
        self._on_exit: Callable[[WorkerHandle], None] = lambda _: None
        # The batch it runs (one at a time), and the loads and unloads it was asked for: a
        # load runs in a thread of the worker's while batches go on.
        self._batch: tuple[int, asyncio.Future[Reply]] | None = None
        self._control: dict[int, asyncio.Future[Reply]] = {}

    @classmethod
    def spawn(
        cls,
        index: int,
        device: str,
        threads: int,
        config: WorkerConfig,
        buffer_size: int,
    ) -> WorkerHandle:
        """Start a worker process: it holds no model until its host has it load some."""
        buffer = InputBuffer.create(buffer_size)
        spec = WorkerSpec(index, device, threads, config, buffer.path, buffer.size, os.getpid())
        parent, child = channel_pair()
        process = mp.get_context("spawn").Process(
            target=_worker_entry, args=(spec, child), name=f"model-worker-{index}", daemon=True
        )
        try:
            with allocator.for_children():
                process.start()
        except BaseException:
            buffer.unlink()
            buffer.close()
            parent.close()
            child.close()
            raise
        child.close()  # so the parent sees EOF the moment the worker dies
        return cls(spec, process, parent, buffer)

    # -- what the pool and the lending rule read ---------------------------------------------

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def device(self) -> str:
        return self.spec.device

    @property
    def threads(self) -> int:
        return self.spec.threads

    @property
    def busy(self) -> bool:
        """Running a batch (a load beside it does not make it busy)."""
        return self._batch is not None

    def running(self, batch_id: int) -> bool:
        """Running batch ``batch_id`` still (not answered, not dead)."""
        return self._batch is not None and self._batch[0] == batch_id

    @property
    def serving(self) -> bool:
        """Alive, ready and not running a batch."""
        return self.alive and self.ready and not self.busy

    @property
    def batch_size(self) -> int:
        """The largest batch any of its models wants."""
        wanted = [model.batch_size for model in self.models.values()]
        return max(wanted, default=self.spec.config.max_batch_size)

    def holds(self, served_id: str) -> bool:
        return self.alive and self.ready and served_id in self.models

    def status(self, restarts: int = 0, versions: Sequence[HeldView] = ()) -> WorkerStatus:
        """This worker for ``/readyz``, ``/info`` and the metrics; ``restarts``: of its slot;
        ``versions``: each version its host says it holds, loads or failed (by name and
        number), with what this worker reported of the export each holds."""
        held = []
        for version in versions:
            report = self.models.get(version.served_id)
            state = version.state.shown
            if report is None or version.state is VersionState.LOADING:
                held.append(
                    HeldModel(version.served_id, state, name=version.name,
                              version=version.version, reason=_said(version))
                )  # fmt: skip
                continue
            held.append(
                HeldModel(
                    report.served_id, state, report.runtime, report.batch_size,
                    report.memory_bytes, name=version.name, version=version.version,
                    skipped=report.skipped, slowdown=report.slowdown, dtype=report.dtype,
                    trials=report.trials, reason=_said(version),
                )
            )  # fmt: skip
        first = next(iter(self.models.values()), None)
        return WorkerStatus(
            index=self.index,
            device=self.device,
            threads=self.threads,
            pid=self.process.pid,
            ready=self.ready,
            alive=self.alive,
            batch_size=self.batch_size,
            batches=self.batches,
            items=self.items,
            rss_bytes=rss_bytes(self.process.pid) if self.alive else None,
            cpu_seconds=cpu_seconds(self.process.pid) if self.alive else None,
            restarts=restarts,
            runtime=first.runtime if first is not None else None,
            models=tuple(held),
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def wait_ready(self) -> None:
        """Wait for the worker's ``Ready``; ``WorkerStartError`` if it reports a failure or
        exits first."""
        try:
            await self.conn.open()
            message = await self.conn.recv()
        except (asyncio.IncompleteReadError, OSError):
            await wait_for_exit(self.process, 1.0)
            raise WorkerCrashed(
                f"worker {self.index} on {self.device} exited during start-up "
                f"(exit code {self.process.exitcode})"
            ) from None
        if isinstance(message, StartFailed):
            raise WorkerStartError(
                f"worker {message.index} on {self.device} failed to start: {message.message}"
            )
        assert isinstance(message, Ready)
        self.ready = True

    def start_reading(
        self, on_idle: Callable[[WorkerHandle], None], on_exit: Callable[[WorkerHandle], None]
    ) -> None:
        """Route the worker's replies from now on: ``on_idle(self)`` once it is ready for
        the next batch (now, and after each reply), ``on_exit(self)`` when its socket closes
        (it died, or stopped). Unlinks the buffer's file: both processes have it mapped, so
        nothing is left to leak from here on."""
        self.buffer.unlink()
        self._on_idle, self._on_exit = on_idle, on_exit
        self._reader = asyncio.create_task(self._read(), name=f"worker-{self.index}-replies")
        self.idle_since = time.monotonic()
        on_idle(self)

    async def _read(self) -> None:
        while True:
            try:
                message = await self.conn.recv()
            except (asyncio.IncompleteReadError, OSError) as exc:
                log.debug("worker %d channel closed: %r", self.index, exc)
                self._on_exit(self)
                return
            self._on_reply(message)

    def _on_reply(self, message: object) -> None:
        replies = BatchDone | BatchFailed | LoadDone | LoadFailed | ModelUnloaded
        batch = isinstance(message, BatchDone | BatchFailed)
        future: asyncio.Future[Reply] | None = None
        if not isinstance(message, replies):
            log.error("worker %d sent an unexpected message %r", self.index, message)
            return
        if batch and self._batch is not None and self._batch[0] == message.batch_id:
            future, self._batch = self._batch[1], None
        elif not batch and message.batch_id in self._control:
            future = self._control.pop(message.batch_id)
        else:
            log.error("worker %d answered a request it was not sent: %r", self.index, message)
            return
        if isinstance(message, LoadDone):
            self.models[message.model.served_id] = message.model
        elif isinstance(message, ModelUnloaded):
            self.models.pop(message.served_id, None)
        if isinstance(message, LoadDone | LoadFailed):
            self.loading = None
        if batch:
            self.idle_since = time.monotonic()
            self._on_idle(self)
        if future.done():
            return
        if isinstance(message, BatchFailed):
            # The full message (it may hold paths) goes to the log, not to HTTP clients.
            log.error("worker %d: batch failed: %s", self.index, message.message)
            future.set_exception(InferenceError("model call failed"))
        elif isinstance(message, LoadFailed):
            text = f"worker {self.index}: {message.message}"
            future.set_exception(
                ModelMemoryBudget(text)
                if message.step == "budget"
                else ModelLoadFailed(text, message.step)
            )
        else:
            future.set_result(message)

    def send(self, message: RunBatch | LoadModel | UnloadModel) -> asyncio.Future[Reply]:
        """Send one request: a batch (one at a time: the pool sends one only to an idle
        worker), or a model to load or unload (any time: a load runs beside the batches).
        The future gets its reply, ``InferenceError`` if the worker reports the batch failed,
        ``ModelLoadFailed`` if the load did, or ``WorkerDied`` once it is marked dead (a
        socket found closed here is reported to ``on_exit`` at once, like one the reader
        finds closed)."""
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        if isinstance(message, RunBatch):
            assert self._batch is None, f"worker {self.index} runs a batch already"
            self._batch = (message.batch_id, future)
            self.batches += 1
            self.items += len(message.ids)
        else:
            self._control[message.batch_id] = future
            if isinstance(message, LoadModel):
                self.loading = message.spec
        try:
            self.conn.send(message)
        except (OSError, RuntimeError):
            self._on_exit(self)
        return future

    def mark_dead(self, reason: str, *, crashed: bool = False) -> None:
        """No longer serving: fail the batch it was running, and any load or unload it was
        asked for, with ``WorkerDied`` (the batch with ``DiedRunning`` when it ``crashed``:
        died of itself, not stopped or killed by the pool)."""
        if self.alive:
            self.alive = False
            if self._reader is not None and self._reader is not asyncio.current_task():
                self._reader.cancel()
        batch = self._batch[1] if self._batch is not None else None
        futures = [*self._control.values()]
        self._batch, self._control = None, {}
        self.died_running = self.died_running or (crashed and batch is not None)
        if batch is not None and not batch.done():
            died = DiedRunning if crashed and self.killed_for is None else WorkerDied
            batch.set_exception(died(reason))
        for future in futures:
            if not future.done():
                future.set_exception(WorkerDied(reason))

    def ask_to_stop(self) -> None:
        if self.alive:
            with contextlib.suppress(OSError, ValueError, AssertionError, RuntimeError):
                self.conn.send(STOP)

    def kill(self, why: str | None = None) -> None:
        """End the process (SIGKILL); ``why``: the pool's own reason (a batch past
        ``MB_BATCH_TIMEOUT``), so that its death is not blamed on a load beside it, and it
        takes no batch meanwhile."""
        if why is not None:
            self.killed_for = why
        self.process.kill()

    async def stop(self, timeout_s: float, reason: str) -> None:
        """Wait up to ``timeout_s`` for the process to exit, kill it if it did not, and
        release its socket and buffer."""
        await wait_for_exit(self.process, timeout_s)
        if self.process.is_alive():
            log.warning("worker %d did not stop in time; killing it", self.index)
            self.process.kill()
            await wait_for_exit(self.process, 5.0)
        self.process.join(timeout=1)
        self.mark_dead(reason)
        self.conn.close()
        self.buffer.unlink()
        self.buffer.close()
