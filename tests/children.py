"""Every process a test starts dies with the test run, however the run ends: pytest's timeout
ends it with ``os._exit`` and a developer or CI with ``kill -9``, and neither runs a test's
clean-up.

A child started here gets SIGKILL from the kernel the moment the test run's process dies (a
parent-death signal: ``app.workers.lineage``). Servers and worker supervisors take their own
children with them the same way, so their children need nothing more. Two catches:

* the kernel sends the signal when the *thread* that started the child ends, not the
  process: a child asked for off the main thread (a test's ``asyncio.to_thread``) is started
  by a thread that lives as long as the process does;
* a child in a process group of its own may lead processes that do not watch their parent
  (``uvicorn --workers``' workers): ``group_guard`` kills the whole group.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from app.workers.lineage import preexec

# Starts the children asked for off the main thread; its one thread never ends before the
# process does (it waits for work until the interpreter exits).
_starter = ThreadPoolExecutor(1, thread_name_prefix="child-starter")
# Reads end of file once the test run's process is gone (only it holds the pipe's other
# end), then kills the group; $0 is the group's id.
_GUARD = 'read _; kill -KILL "-$0" 2>/dev/null'


def dies_with_run() -> Callable[[], None]:
    """A ``preexec_fn`` for a child of this thread (a ``subprocess.run``, which this thread
    waits for): it gets SIGKILL when the test run's process dies."""
    return preexec(signal.SIGKILL)


def start(command: list[str], *, own_group: bool = False, **popen: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(command, **popen)``, started so that it dies with the test run
    (from any thread); ``own_group``: in a session and process group of its own, which
    terminal signals (a Ctrl-C) do not reach and ``os.killpg`` ends whole."""

    def launch() -> subprocess.Popen[Any]:
        return subprocess.Popen(
            command, preexec_fn=dies_with_run(), start_new_session=own_group, **popen
        )

    if threading.current_thread() is threading.main_thread():
        return launch()
    return _starter.submit(launch).result()


@contextlib.contextmanager
def group_guard(process: subprocess.Popen[Any]) -> Iterator[None]:
    """While the block runs, the group ``process`` leads (started with ``own_group``) dies
    whole with the test run, members that do not watch their parent too: a guard (``sh``, in
    a session of its own so that a Ctrl-C spares it) waits on a pipe only this process holds
    and kills the group when the pipe closes. Leaving the block closes it: the guard kills
    what is left of the group and exits. Only for the block's length: a group id is a pid,
    reused once its group is gone."""
    guard = subprocess.Popen(
        ["sh", "-c", _GUARD, str(process.pid)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield
    finally:
        assert guard.stdin is not None
        guard.stdin.close()
        guard.wait(timeout=10)
