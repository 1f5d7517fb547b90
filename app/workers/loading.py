"""A model load in a thread of its own, inside a worker process: the worker goes on running
batches of the versions it serves while the new one is verified, loaded, self-tested and
warmed up (OpenVINO's compile and torch's ops release the GIL for most of that time). The
thread only prepares the model; the thread that runs batches puts it in service
(``PreparedWorker.hold``), so batches never see a model half added.

A load cannot be stopped: one past its deadline is given up by its owner (the pool's worker
loop, or a broker worker's versions), and what it loads late is dropped (``drop``).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from app.lifecycle import ModelSpec
from app.workers.process import LoadFailure, PreparedModel, PreparedWorker

log = logging.getLogger("app.worker")


class Loading:
    """One load of ``spec`` into ``worker``, in a daemon thread: ``done`` once it ended,
    then ``model`` (prepared, not yet in service) or ``failure`` (``LoadFailure``).
    ``wake``: a pipe's write end the thread writes a byte to when it ends, for a loop that
    waits on several things at once.

    >>> # loading = Loading(worker, spec)
    >>> # ... batches run meanwhile ...
    >>> # if loading.done and loading.model is not None: worker.hold(loading.model)
    """

    def __init__(self, worker: PreparedWorker, spec: ModelSpec, wake: int | None = None) -> None:
        self.worker = worker
        self.spec = spec
        self.started = time.monotonic()
        self.model: PreparedModel | None = None
        self.failure: LoadFailure | None = None
        self._wake = wake
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"load-{spec.name}-{spec.version}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            self.worker.own_thread()
            self.model = self.worker.load(self.spec, hold=False)
        except LoadFailure as exc:
            self.failure = exc
        except BaseException as exc:  # a bug in a load must fail the load, not the worker
            log.exception("loading %s failed unexpectedly", self.spec.served_id)
            self.failure = LoadFailure(self.spec, "load", f"{type(exc).__name__}: {exc}")
        finally:
            self._done.set()
            if self._wake is not None:
                os.write(self._wake, b"x")

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def age_s(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.started

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)

    def drop(self) -> None:
        """A late load's model, never put in service: its memory goes back."""
        if self.model is not None:
            self.model.close()
            self.model = None
            log.info("dropped %s, loaded past its deadline", self.spec.served_id)
