"""The real command line: `python -m app` (uvicorn) in its own process, signals included."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import distinct_images

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(port: int, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "app"],
        cwd=REPO,
        env={**os.environ, "HOST": "127.0.0.1", "PORT": str(port), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def alive(pid: int) -> bool:
    """True for a running process; a zombie (exited, not yet reaped) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def shm_files() -> set[str]:
    return (
        {p.name for p in Path("/dev/shm").glob("microbatch-*")}
        if Path("/dev/shm").is_dir()
        else set()
    )


def test_serves_then_exits_cleanly_on_sigterm(tiny_store: Path) -> None:
    port = free_port()
    shm_before = shm_files()
    server = start_server(
        port, {"MODEL_STORE": str(tiny_store), "CUDA_DEVICES": "cpu", "MB_WORKER_NUM": "2"}
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, server.stdout.read() if server.stdout else ""
            try:
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server never became ready"
            time.sleep(0.2)
        workers = children_of(server.pid)
        assert len(workers) >= 2
        response = httpx.post(
            f"{base}/predict/tag", files={"image": ("x.png", distinct_images(1)[0])}, timeout=10
        )
        assert response.status_code == 200 and len(response.json()) == 5
        server.send_signal(signal.SIGTERM)
        output, _ = server.communicate(timeout=30)
        assert server.returncode == 0, output
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if alive(pid)], "orphan process left"
    assert shm_files() == shm_before


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MB_BATCH_SIZE": "0"}, "MB_BATCH_SIZE"),
        ({"CUDA_DEVICES": "first"}, "CUDA_DEVICES"),
        ({"MODEL_STORE": "/nonexistent/store"}, "app.export"),
    ],
)
def test_bad_configuration_fails_at_start_with_a_clear_message(
    tiny_store: Path, env: dict[str, str], message: str
) -> None:
    server = start_server(
        free_port(), {"MODEL_STORE": str(tiny_store), "CUDA_DEVICES": "cpu", **env}
    )
    try:
        output, _ = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert server.returncode != 0
    assert message in output
