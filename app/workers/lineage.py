"""A process never outlives what supervises it, even when that is killed with ``-9``.

A child asks the kernel for a signal the moment its parent dies (Linux's parent-death
signal, ``prctl(PR_SET_PDEATHSIG)``), then checks that its parent is still the one that
started it: a parent that died between the fork and the ``prctl`` would otherwise never be
noticed. The signal survives ``exec`` (of a binary that is not set-uid), so a launcher sets it
for the programs it starts too (``preexec``). Where there is no ``prctl`` (not Linux), a
thread polls the parent's pid instead.

Model workers take ``SIGKILL``: nobody waits for their answers any more, and a broker
worker's unfinished entries are reclaimed by the others, as for any dead worker. Processes
that can stop well (front ends, a supervisor, Redis) take ``SIGTERM``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
POLL_S = 0.5  # where the parent is watched by polling


@functools.cache
def _prctl() -> Any:
    """libc's ``prctl``, looked up once (``preexec`` does it before the fork)."""
    return ctypes.CDLL(None, use_errno=True).prctl


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """In a child of ``parent_pid``: get ``sig`` when the parent dies; exit at once if it
    already has."""
    if sys.platform.startswith("linux"):
        if _prctl()(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:  # pragma: no cover - the servers run on Linux
        threading.Thread(target=_watch, args=(parent_pid, sig), daemon=True).start()
    if os.getppid() != parent_pid:  # it died before the prctl: nobody would tell us
        os._exit(1)


def _watch(parent_pid: int, sig: int) -> None:  # pragma: no cover - not Linux
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    os.kill(os.getpid(), sig)


def preexec(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the program started dies (``sig``) with the
    process that starts it."""
    parent = os.getpid()
    if sys.platform.startswith("linux"):
        # Looked up here, before the fork: between the fork and the exec, where another
        # thread of the parent may have held the dynamic loader's lock, the child only calls.
        _prctl()

    def in_the_child() -> None:
        with contextlib.suppress(OSError):  # no prctl: the child still runs, unguarded
            die_with_parent(parent, sig)

    return in_the_child


def stop_child(process: subprocess.Popen[Any], timeout_s: float) -> int:
    """Stop a child well: SIGTERM, then SIGKILL if it is still there after ``timeout_s``;
    its exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()
