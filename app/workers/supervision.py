"""Keeping a worker pool's processes running: a worker that dies (or hangs on a batch and is
killed) fails its in-flight batch at once and is restarted with capped exponential backoff,
while the others keep serving; once back, its host loads what it should hold, as for any
worker that starts (``app.workers.hosting``). A worker that crashes while it loads and
self-tests its runtimes under ``MB_RUNTIME=auto`` is started again with TorchScript alone
(native code that aborts on this host is caught no other way)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from collections.abc import Sequence
from typing import Protocol

from app.errors import WorkerStartError
from app.plan import Placement, WorkerConfig
from app.workers.backoff import RestartBackoff
from app.workers.handle import WorkerHandle
from app.workers.hosting import PoolHost

log = logging.getLogger("app.workers.pool")

# The exit codes of a process native code crashed: aborted, segfaulted, and the like.
CRASHES = frozenset(
    -sig for sig in (signal.SIGABRT, signal.SIGSEGV, signal.SIGILL, signal.SIGBUS, signal.SIGFPE)
)


class SupervisedPool(Protocol):
    """What ``Supervision`` reads and calls of its pool (``app.workers.pool.WorkerPool``)."""

    config: WorkerConfig  # set to TorchScript alone after a crash under MB_RUNTIME=auto

    @property
    def placement(self) -> Placement: ...

    @property
    def start_timeout_s(self) -> float: ...

    @property
    def host(self) -> PoolHost: ...

    @property
    def workers(self) -> Sequence[WorkerHandle]: ...

    @property
    def closing(self) -> bool: ...

    def replace(self, index: int) -> WorkerHandle:
        """Spawn a new worker in slot ``index`` (its last one died)."""

    def serve(self, worker: WorkerHandle) -> None:
        """Route ``worker``'s replies from now on, and put it in the batch rotation."""

    def forget(self, worker: WorkerHandle) -> None:
        """``worker`` died: out of the rotation."""


class Supervision:
    """The pool's worker restarts (``on_exit`` starts one) and start-up waits."""

    def __init__(self, pool: SupervisedPool) -> None:
        self.pool = pool
        self.backoff = RestartBackoff()
        self.restarted = [0] * len(pool.placement.devices)  # by worker slot
        self._restarts: dict[int, asyncio.Task[None]] = {}

    async def aclose(self) -> None:
        for task in self._restarts.values():
            task.cancel()
        await asyncio.gather(*self._restarts.values(), return_exceptions=True)

    async def wait_ready(self, index: int) -> WorkerHandle:
        """Wait until worker ``index`` is ready (it starts holding nothing: its host loads
        its models next), and return it."""
        worker = self.pool.workers[index]
        await worker.wait_ready()
        return worker

    def load_crashed(self, worker: WorkerHandle) -> bool:
        """``worker`` died while it loaded a model. Under ``MB_RUNTIME=auto``, if it crashed
        (a signal native code dies of: an abort, a segfault; not a kill, which is the OOM
        killer's or an operator's), a runtime other than TorchScript may crash on this host,
        which no self-test can catch in-process: from now on this pool serves with
        TorchScript only, and True says a load may then work; otherwise False."""
        if self.pool.config.runtime != "auto":
            return False
        worker.process.join(timeout=2)
        if worker.process.exitcode not in CRASHES:
            return False
        log.error(
            "worker %d on %s crashed while loading its runtimes (exit code %s); a runtime "
            "other than TorchScript may crash on this host: this pool serves with TorchScript "
            "only",
            worker.index,
            worker.device,
            worker.process.exitcode,
        )
        self.pool.config = dataclasses.replace(self.pool.config, runtime="torchscript")
        return True

    def on_exit(self, worker: WorkerHandle) -> None:
        """``worker``'s socket closed: an ordinary exit when the pool closes, else a death:
        what it ran fails now (``WorkerDied``), and it restarts."""
        if not worker.alive:
            return
        pool = self.pool
        if pool.closing:  # it was told to stop: an ordinary exit
            worker.mark_dead("worker pool is shutting down")
            pool.forget(worker)
            return
        worker.process.join(timeout=0.1)
        log.error(
            "worker %d on %s died (exit code %s)",
            worker.index,
            worker.device,
            worker.process.exitcode,
        )
        worker.mark_dead(f"model worker {worker.index} died", crashed=True)
        pool.forget(worker)
        pool.host.wake()
        self._restarts[worker.index] = asyncio.create_task(
            self._restart(worker), name=f"restart-{worker.index}"
        )

    async def _restart(self, dead: WorkerHandle) -> None:
        index, pool = dead.index, self.pool
        try:
            await dead.stop(0.0, f"model worker {index} died")
            while not pool.closing:
                delay = self.backoff.next_delay(index)
                log.warning("restarting worker %d on %s in %.1f s", index, dead.device, delay)
                await asyncio.sleep(delay)
                try:  # the OS may refuse a process or its buffer now (EAGAIN, ENOMEM, EMFILE)
                    pool.replace(index)
                except Exception as exc:
                    log.error("worker %d could not be started again: %r", index, exc)
                    continue  # later, as after a failed start: never a slot given up
                try:
                    worker = await asyncio.wait_for(self.wait_ready(index), pool.start_timeout_s)
                except (WorkerStartError, TimeoutError) as exc:
                    log.error("worker %d failed to restart: %s", index, exc)
                    worker = pool.workers[index]
                    worker.kill()
                    await worker.stop(1.0, "restart failed")
                    continue
                pool.serve(worker)
                self.restarted[index] += 1
                log.info(
                    "worker %d on %s restarted (pid %s)", index, dead.device, worker.process.pid
                )
                pool.host.wake()  # it loads what it should hold, as any worker that starts
                return
        finally:
            if self._restarts.get(index) is asyncio.current_task():
                del self._restarts[index]
