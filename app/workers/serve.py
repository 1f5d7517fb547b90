"""A pool's worker process, once started (``worker_main``, spawned by ``app.workers.pool``):
it says ``Ready`` holding no model, then answers what the pool sends, in order
(``app.workers.messages``): a batch to run (``app.workers.compute``), a model to unload,
or a model to load, which loads in a thread of its own (``app.workers.loading``) while the
batches that come meanwhile run as usual; ``LoadDone`` (or ``LoadFailed``) is sent when the
load ends, or at its deadline. Its first models load that way too: start-up is a load.
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
from app.workers.channel import post
from app.workers.compute import run_message
from app.workers.loading import LoadSlot
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
from app.workers.process import PreparedWorker, start_failure

log = logging.getLogger("app.worker")


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a pool's worker process."""
    configure_logging(spec.config.log_level, spec.config.log_format)
    tracing.configure("worker")
    try:
        worker = PreparedWorker(spec.config, spec.device, spec.threads)
        buffer = InputBuffer(spec.buffer_path, spec.buffer_size)
    except BaseException as exc:
        post(conn, StartFailed(spec.index, start_failure(exc)))
        conn.close()
        return
    post(conn, Ready(spec.index, spec.device, spec.threads, os.getpid()))
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
        self._slot = LoadSlot(timeout_s=0)
        self._asked: LoadModel | None = None  # the message of the running load

    def run(self) -> None:
        try:
            while self._turn():
                pass
        finally:
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _turn(self) -> bool:
        """Wait for a message or a load's end; handle what came. False once told to stop."""
        ready = wait([self.conn, self._wake_r], timeout=self._slot.due_in())
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
            post(self.conn, ModelUnloaded(message.batch_id, message.served_id, anonymous_bytes()))
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
        post(self.conn, reply)
        self.worker.memory.after_batch()

    def _start_load(self, message: LoadModel) -> None:
        held = self.worker.models.get(message.spec.served_id)
        if held is not None:
            post(self.conn, LoadDone(message.batch_id, held.report))
        elif self._slot.busy:  # the pool loads one at a time: a bug if it did not
            post(
                self.conn,
                LoadFailed(message.batch_id, message.spec.served_id, "load", "already loading"),
            )
        elif self._slot.late(message.spec):  # given up at its deadline, and still running:
            # not twice at once (two copies in memory, past MB_MODEL_MEMORY unseen)
            post(
                self.conn,
                LoadFailed(
                    message.batch_id, message.spec.served_id, "timeout",
                    "its last load, given up at its deadline, still runs: try again later",
                ),
            )  # fmt: skip
        else:
            self._asked = message
            self._slot.start(
                self.worker, message.spec, self._wake_w, message.delay_s, message.timeout_s
            )

    def _finish_loads(self) -> None:
        ended = self._slot.poll()
        if ended is None:
            return
        message, self._asked = self._asked, None
        assert message is not None
        if ended.failure is not None:
            failure = ended.failure
            log.error("loading %s failed", failure.describe())
            post(
                self.conn,
                LoadFailed(message.batch_id, message.spec.served_id, failure.step, failure.message),
            )
            return
        assert ended.model is not None
        self.worker.hold(ended.model)
        post(self.conn, LoadDone(message.batch_id, ended.model.report))
