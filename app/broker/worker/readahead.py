"""When a broker worker reads its next batch: as the current one is about to end, so the read
overlaps the compute and still takes everything that piled up meanwhile; and never more than
one read ahead, so no worker holds a backlog out of the others' reach."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


def ewma(average: float, value: float) -> float:
    return value if average == 0 else 0.8 * average + 0.2 * value


class ReadAhead(Generic[T]):
    """A one-slot hand-off between a reader thread and the thread that computes.

    >>> ahead: ReadAhead[str] = ReadAhead()
    >>> ahead.wait_turn(threading.Event())  # nothing computes, the slot is empty: read now
    True
    >>> ahead.put("batch 1", read_s=0.001)
    >>> ahead.take(timeout_s=0)
    'batch 1'
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._slot: T | None = None
        self._busy_since: float | None = None  # while a batch computes (not while it answers)
        self._compute_s = 0.0  # EWMAs of a batch's compute and of a read
        self._read_s = 0.0

    def _due_in(self) -> float | None:
        """Seconds until the reader may read (0: now); None while the slot is full."""
        if self._slot is not None:
            return None
        if self._busy_since is None:
            return 0.0
        return max(0.0, self._busy_since + self._compute_s - self._read_s - time.monotonic())

    def wait_turn(self, stop: threading.Event) -> bool:
        """Block until the reader may read; False once ``stop`` is set."""
        with self._cond:
            while not stop.is_set():
                due = self._due_in()
                if due == 0.0:
                    return True
                self._cond.wait(0.5 if due is None else max(0.001, due))
            return False

    def put(self, read: T, read_s: float) -> None:
        """Hand over a read that took ``read_s`` (only reads made while a batch computed
        teach anything about reads: the others waited for entries to exist)."""
        with self._cond:
            if self._busy_since is not None:
                self._read_s = ewma(self._read_s, read_s)
            self._slot = read
            self._cond.notify_all()

    def take(self, timeout_s: float) -> T | None:
        """The read waiting, if any within ``timeout_s``."""
        with self._cond:
            if self._slot is None and timeout_s > 0:
                self._cond.wait(timeout_s)
            read, self._slot = self._slot, None
            self._cond.notify_all()  # the reader may read again
            return read

    @contextmanager
    def computing(self) -> Iterator[None]:
        """Around one batch's compute: the reader times its next read by it."""
        started = time.monotonic()
        with self._cond:
            self._busy_since = started
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._busy_since = None
                self._compute_s = ewma(self._compute_s, time.monotonic() - started)
                self._cond.notify_all()

    @property
    def busy_for(self) -> float:
        """Seconds the batch computing now has taken so far (0 when none)."""
        busy_since = self._busy_since
        return 0.0 if busy_since is None else time.monotonic() - busy_since
