"""Keeping a worker pool's processes running: a worker that dies (or hangs on a batch and is
killed) fails its in-flight batch at once and is restarted with capped exponential backoff,
with the models the pool serves then, while the others keep serving. A worker that crashes
while it loads and self-tests its runtimes under ``MB_RUNTIME=auto`` is started again with
TorchScript alone (native code that aborts on this host is caught no other way)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import Protocol

from app.errors import ModelLoadFailed, WorkerDied, WorkerStartError
from app.plan import Placement, WorkerConfig
from app.workers.backoff import RestartBackoff
from app.workers.handle import WorkerCrashed, WorkerHandle
from app.workers.hosting import PoolModels

log = logging.getLogger("app.workers.pool")


class SupervisedPool(Protocol):
    """What ``Supervision`` reads and calls of its pool (``app.workers.pool.WorkerPool``)."""

    config: WorkerConfig  # set to TorchScript alone after a crash under MB_RUNTIME=auto

    @property
    def placement(self) -> Placement: ...

    @property
    def start_timeout_s(self) -> float: ...

    @property
    def hosting(self) -> PoolModels: ...

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
        """Wait until worker ``index`` is ready, and return it. Under ``MB_RUNTIME=auto`` a
        worker that crashes while it loads and self-tests the runtimes (native code that
        aborts on this host, which no self-test can catch in-process) is started again with
        TorchScript alone, and so is every later start of this pool."""
        worker = self.pool.workers[index]
        try:
            await worker.wait_ready()
        except WorkerCrashed as exc:
            if self.pool.config.runtime != "auto":
                raise
            log.error(
                "worker %d on %s crashed while loading its runtimes (%s); a runtime other than "
                "TorchScript may crash on this host: this pool serves with TorchScript only",
                index,
                worker.device,
                exc,
            )
            self.pool.config = dataclasses.replace(self.pool.config, runtime="torchscript")
            await worker.stop(0.0, "crashed during start-up")
            worker = self.pool.replace(index)
            await worker.wait_ready()
        if self.pool.config.auto_batch:
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
        worker.mark_dead(f"model worker {worker.index} died")
        pool.forget(worker)
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
                pool.replace(index)
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
                try:  # under the lock: after any load or unload that ran meanwhile
                    await pool.hosting.catch_up(worker)
                except (ModelLoadFailed, WorkerDied) as exc:
                    log.error("worker %d could not catch up on the models: %s", index, exc)
                    worker.kill()
                return
        finally:
            if self._restarts.get(index) is asyncio.current_task():
                del self._restarts[index]
