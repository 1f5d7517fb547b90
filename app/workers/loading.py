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
from dataclasses import dataclass

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

    def __init__(
        self,
        worker: PreparedWorker,
        spec: ModelSpec,
        wake: int | None = None,
        delay_s: float | None = None,
    ) -> None:
        self.worker = worker
        self.spec = spec
        self.delay_s = delay_s
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
            self.model = self.worker.load(self.spec, hold=False, delay_s=self.delay_s)
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


@dataclass(frozen=True)
class Ended:
    """A load that ended: its model (prepared, not yet in service), or why it failed
    (``LoadFailure``, step ``timeout`` for one past its deadline), and how long it took."""

    spec: ModelSpec
    model: PreparedModel | None
    failure: LoadFailure | None
    seconds: float


class LoadSlot:
    """One load at a time, with its deadline (``timeout_s``; 0: none): ``poll`` says when it
    ended, failed or ran late. A late load cannot be stopped: it is given up (``poll`` ends
    it with step ``timeout``) and left to finish, and what it loads is dropped then. The
    one handling of a load's end, for a pool's worker (``app.workers.serve``) and a broker
    worker (``app.broker.worker.versions``).

    >>> # slot = LoadSlot(timeout_s=300)
    >>> # slot.start(worker, spec)              # in a thread; batches go on
    >>> # ended = slot.poll()                   # None while it runs
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.running: Loading | None = None
        self._late: list[Loading] = []  # given up at their deadline, still running

    @property
    def busy(self) -> bool:
        return self.running is not None

    def start(
        self,
        worker: PreparedWorker,
        spec: ModelSpec,
        wake: int | None = None,
        delay_s: float | None = None,
        timeout_s: float | None = None,
    ) -> None:
        assert self.running is None, "one load at a time"
        if timeout_s is not None:
            self.timeout_s = timeout_s
        self.running = Loading(worker, spec, wake, delay_s)

    def late(self, spec: ModelSpec) -> bool:
        """Whether a load of ``spec`` given up at its deadline still runs."""
        return any(loading.spec.served_id == spec.served_id for loading in self._late)

    def due_in(self) -> float | None:
        """Seconds until the running load's deadline (None: none to watch)."""
        if self.running is None or not self.timeout_s:
            return None
        return max(0.0, self.timeout_s - self.running.age_s())

    def poll(self, now: float | None = None) -> Ended | None:
        """The running load, if it ended (or ran past its deadline: given up); late ones
        that ended are dropped."""
        for late in [loading for loading in self._late if loading.done]:
            self._late.remove(late)
            late.drop()
        loading = self.running
        if loading is None:
            return None
        now = time.monotonic() if now is None else now
        if loading.done:
            self.running = None
            return Ended(loading.spec, loading.model, loading.failure, loading.age_s(now))
        if self.timeout_s and loading.age_s(now) >= self.timeout_s:
            self.running = None
            self._late.append(loading)
            reason = f"not loaded after MB_WORKER_START_TIMEOUT={self.timeout_s:g} s"
            log.error("loading %s: %s; giving it up", loading.spec.served_id, reason)
            failure = LoadFailure(loading.spec, "timeout", reason)
            return Ended(loading.spec, None, failure, loading.age_s(now))
        return None
