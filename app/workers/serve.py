"""A pool's worker process, once started (``worker_main``, spawned by ``app.workers.pool``):
it loads the models it is given, says ``Ready``, then answers what the pool sends, in order
(``app.workers.messages``): a batch to run (``app.workers.compute``), a model to unload,
or a model to load, which loads in a thread of its own (``app.workers.loading``) while the
batches that come meanwhile run as usual; ``LoadDone`` (or ``LoadFailed``) is sent when the
load ends, or at its deadline.
"""

from __future__ import annotations

import logging
import os
import traceback
from multiprocessing.connection import Connection, wait

from app import tracing
from app.logs import configure_logging
from app.workers.allocator import anonymous_bytes
from app.workers.buffer import InputBuffer
from app.workers.compute import run_message
from app.workers.loading import Loading
from app.workers.messages import (
    STOP,
    BatchDone,
    BatchFailed,
    LoadDone,
    LoadFailed,
    LoadModel,
    ModelUnloaded,
    Ready,
    RunBatch,
    StartFailed,
    UnloadModel,
    WorkerSpec,
)
from app.workers.process import PreparedWorker, prepare, start_failure

log = logging.getLogger("app.worker")


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a pool's worker process."""
    configure_logging(spec.config.log_level, spec.config.log_format)
    tracing.configure("worker")
    try:
        worker = prepare(spec.config, spec.device, spec.threads, spec.models, spec.load_delay_s)
        buffer = InputBuffer(spec.buffer_path, spec.buffer_size)
    except BaseException as exc:
        conn.send(StartFailed(spec.index, start_failure(exc)))
        conn.close()
        return
    reports = tuple(model.report for model in worker.models.values())
    conn.send(Ready(spec.index, spec.device, spec.threads, os.getpid(), reports))
    try:
        WorkerLoop(worker, buffer, conn).run()
    finally:
        tracing.shutdown()  # export the last spans


class WorkerLoop:
    """What a pool's worker does until told to stop: answer each message in order, and the
    load running beside them when it ends (or passes its deadline)."""

    def __init__(self, worker: PreparedWorker, buffer: InputBuffer, conn: Connection) -> None:
        self.worker = worker
        self.buffer = buffer
        self.conn = conn
        self._wake_r, self._wake_w = os.pipe()  # a load's thread says it ended
        self._loading: tuple[LoadModel, Loading] | None = None
        self._late: list[Loading] = []  # given up at their deadline, still running

    def run(self) -> None:
        try:
            while self._turn():
                pass
        finally:
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _turn(self) -> bool:
        """Wait for a message or a load's end; handle what came. False once told to stop."""
        ready = wait([self.conn, self._wake_r], timeout=self._due_in())
        if self._wake_r in ready:
            os.read(self._wake_r, 64)
        self._finish_loads()
        if self.conn not in ready:
            return True
        try:
            message = self.conn.recv()
        except (EOFError, OSError):  # the pool went away: nothing left to serve
            return False
        if message is STOP:
            self.conn.close()
            return False
        if isinstance(message, LoadModel):
            self._start_load(message)
        elif isinstance(message, UnloadModel):
            self.worker.unload(message.served_id)
            self.conn.send(ModelUnloaded(message.batch_id, message.served_id, anonymous_bytes()))
        else:
            assert isinstance(message, RunBatch)
            self._run(message)
        return True

    def _run(self, message: RunBatch) -> None:
        try:
            reply: BatchDone | BatchFailed = run_message(self.worker, self.buffer, message)
        except Exception as exc:
            log.error("batch %d failed:\n%s", message.batch_id, traceback.format_exc())
            reply = BatchFailed(message.batch_id, message.ids, f"{type(exc).__name__}: {exc}")
        self.conn.send(reply)
        self.worker.memory.after_batch()

    def _start_load(self, message: LoadModel) -> None:
        held = self.worker.models.get(message.spec.served_id)
        if held is not None:
            self.conn.send(LoadDone(message.batch_id, held.report))
        elif self._loading is not None:  # the pool loads one at a time: a bug if it did not
            self.conn.send(
                LoadFailed(message.batch_id, message.spec.served_id, "load", "already loading")
            )
        else:
            self._loading = (message, Loading(self.worker, message.spec, wake=self._wake_w))

    def _due_in(self) -> float | None:
        """Seconds until the running load's deadline (None: no deadline to watch)."""
        if self._loading is None or not self._loading[0].timeout_s:
            return None
        message, loading = self._loading
        return max(0.0, message.timeout_s - loading.age_s())

    def _finish_loads(self) -> None:
        for late in [loading for loading in self._late if loading.done]:
            self._late.remove(late)
            late.drop()
        if self._loading is None:
            return
        message, loading = self._loading
        if loading.done:
            self._loading = None
            if loading.failure is not None:
                failure = loading.failure
                log.error("loading %s failed", failure.describe())
                self.conn.send(
                    LoadFailed(
                        message.batch_id, message.spec.served_id, failure.step, failure.message
                    )
                )
                return
            assert loading.model is not None
            self.worker.hold(loading.model)
            self.conn.send(LoadDone(message.batch_id, loading.model.report))
        elif message.timeout_s and loading.age_s() >= message.timeout_s:
            self._loading = None
            self._late.append(loading)
            reason = f"not loaded after MB_WORKER_START_TIMEOUT={message.timeout_s:g} s"
            log.error("loading %s: %s; giving it up", message.spec.served_id, reason)
            self.conn.send(LoadFailed(message.batch_id, message.spec.served_id, "timeout", reason))
