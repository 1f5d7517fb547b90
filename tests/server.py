"""A real server process (`python -m app`) on 127.0.0.1 for tests where processes, sockets
and signals matter."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from tests.children import start

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def on_jemalloc(pid: int) -> bool:
    """Whether process ``pid`` has jemalloc mapped (the workers' allocator, when installed)."""
    return "libjemalloc" in Path(f"/proc/{pid}/maps").read_text()


def alive(pid: int) -> bool:
    """True for a running process; a zombie (exited, not yet reaped) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def shm_files(pid: int) -> set[str]:
    """The input buffers process ``pid`` made that /dev/shm still holds (only its own: the
    other tests running beside it make and remove theirs meanwhile)."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob(f"microbatch-{pid}-*")} if shm.is_dir() else set()


class ChildProcess:
    """A process a test started: ``stop()`` it, or leave its ``with`` block, and nothing of
    it is left running (its whole process group, when it has one of its own); it dies with
    the test run, however that ends (``tests.children``)."""

    process: subprocess.Popen[str] | None = None
    output = ""
    own_group = False  # started in a session and process group of its own
    name = "process"

    def spawn(self, command: list[str], env: dict[str, str], **popen: Any) -> None:
        """Start ``command`` with its output (stdout and stderr) going to a file, read into
        ``self.output`` once it ends: a pipe nobody reads while the test runs would fill, and
        a process that logs every request would then block on its next line."""
        # Closed with the object (a test may read its output after the process ended).
        self._log = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")  # noqa: SIM115
        self.process = start(
            command, own_group=self.own_group, cwd=REPO, env=env, stdout=self._log,
            stderr=subprocess.STDOUT, text=True, **popen,
        )  # fmt: skip

    def _collect(self, timeout_s: float | None = None) -> None:
        assert self.process is not None
        log = getattr(self, "_log", None)
        if log is None:  # started by a subclass of its own, on a pipe
            self.output = self.process.communicate(timeout=timeout_s)[0]
            return
        self.process.wait(timeout=timeout_s)
        if not log.closed:
            log.seek(0)
            self.output = log.read()
            log.close()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        """Send ``sig`` and wait; returns the exit status (output in ``self.output``)."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            self._collect(timeout_s)
        except subprocess.TimeoutExpired:
            self._kill()
            self._collect()
            raise AssertionError(f"{self.name} did not stop within {timeout_s} s") from None
        return self.process.returncode

    def _kill(self) -> None:
        assert self.process is not None
        if self.own_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        else:
            self.process.kill()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.stop()
        else:  # it died (a test killed it): collect its output
            self._collect()
        if self.own_group:
            self._kill()


class ServerProcess(ChildProcess):
    """``with ServerProcess(MODEL_STORE=...) as server:`` starts the server and waits until
    /readyz answers 200; leaving the block stops it (SIGTERM, then SIGKILL)."""

    name = "server"
    argv: tuple[str, ...] = ("-m", "app")  # what runs (a test's own script injects a fault)

    def __init__(self, **env: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "HOST": "127.0.0.1",
            "PORT": str(self.port),
            "CUDA_DEVICES": "cpu",
            "LOG_LEVEL": "warning",
            **env,
        }
        self.process: subprocess.Popen[str] | None = None
        self.output = ""

    def start(self, ready_timeout_s: float = 90, *, ready: bool = True) -> ServerProcess:
        """Start the server and wait until /readyz answers 200 (``ready=False``: answers at
        all, for a server that must not become ready); one that does not within
        ``ready_timeout_s`` is killed."""
        self.spawn([sys.executable, *self.argv], self.env)
        assert self.process is not None
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if self.process.poll() is not None:
                self._collect()
                raise AssertionError(f"server exited during start:\n{self.output}")
            try:
                answer = httpx.get(f"{self.base_url}/readyz", timeout=1)
                if answer.status_code == 200 or not ready:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop(signal.SIGKILL)  # nothing of it outlives the failed start
                raise AssertionError(f"server never became ready:\n{self.output}")
            time.sleep(0.1)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def readiness(self) -> tuple[int, dict[str, Any]]:
        response = httpx.get(f"{self.base_url}/readyz", timeout=5)
        return response.status_code, response.json()

    def worker_pids(self) -> list[int]:
        return [w["pid"] for w in self.readiness()[1]["workers"]]

    def __enter__(self) -> ServerProcess:
        return self.start()
