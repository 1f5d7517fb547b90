"""The real command line: `python -m app` (uvicorn) in its own process, signals included."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from http.client import HTTPConnection
from pathlib import Path

import httpx
import pytest

from app.workers.allocator import jemalloc_library
from tests.children import dies_with_run
from tests.conftest import distinct_images
from tests.server import REPO, ServerProcess, alive, free_port, on_jemalloc, shm_files

pytestmark = pytest.mark.slow


def test_serves_then_exits_cleanly_on_sigterm(tiny_store: Path) -> None:
    with ServerProcess(MODEL_STORE=str(tiny_store), MB_WORKER_NUM="2") as server:
        pool = server.pid  # whose input buffers go to /dev/shm
        workers = server.worker_pids()
        assert len(workers) == 2
        if jemalloc_library() is not None:  # workers run on it (app.workers.allocator)
            assert all(on_jemalloc(pid) for pid in workers)
        response = httpx.post(
            f"{server.base_url}/predict/tag",
            files={"image": ("x.png", distinct_images(1)[0])},
            timeout=10,
        )
        assert response.status_code == 200 and len(response.json()) == 5
        assert server.stop() == 0, server.output
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if alive(pid)], "orphan worker left"
    assert not shm_files(pool)


def test_an_idle_connection_outlives_uvicorns_five_seconds_then_closes_at_mb_keep_alive(
    tiny_store: Path,
) -> None:
    # Found by the lifecycle test: its client reused a connection idle for 5 s just as
    # uvicorn's default keep-alive closed it ("server disconnected without a response"), the
    # race a load balancer in front loses with a 502.
    with ServerProcess(MODEL_STORE=str(tiny_store), MB_KEEP_ALIVE="7") as server:
        reused, dropped = (HTTPConnection("127.0.0.1", server.port, timeout=10) for _ in "ab")
        try:
            for connection in (reused, dropped):
                assert _health(connection) == 200
            first = reused.sock
            time.sleep(5.5)
            assert _health(reused) == 200 and reused.sock is first  # the same connection
            time.sleep(2.5)  # dropped: idle 8 s
            assert dropped.sock.recv(1) == b"", "the server should have closed it at 7 s"
        finally:
            reused.close()
            dropped.close()


def _health(connection: HTTPConnection) -> int:
    connection.request("GET", "/healthz")
    answer = connection.getresponse()
    answer.read()
    return answer.status


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
    full_env = {
        **os.environ,
        "PORT": str(free_port()),
        "MODEL_STORE": str(tiny_store),
        "CUDA_DEVICES": "cpu",
        **env,
    }
    result = subprocess.run(
        [sys.executable, "-m", "app"],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=dies_with_run(),
    )
    assert result.returncode != 0
    assert message in result.stdout + result.stderr


def test_the_compose_files_defaults_start_the_server(tiny_store: Path) -> None:
    """What `docker compose up` passes (each ${NAME:-default} unset, so its default; an
    empty ${NAME:-} as the empty string) is a configuration the server starts with."""
    import re

    import yaml

    compose = yaml.safe_load((REPO / "docker" / "docker-compose.yml").read_text())
    for service in ("server", "server-gpu"):
        env = {}
        for key, expression in compose["services"][service]["environment"].items():
            match = re.fullmatch(r"\$\{(\w+):-(.*)\}", str(expression))
            env[key] = match.group(2) if match else str(expression)
        env["CUDA_DEVICES"] = "cpu"  # no GPU here; "auto" would also fall back to the CPU
        if "MB_GRPC_PORT" in env:  # the container's port; here, any free one
            env["MB_GRPC_PORT"] = str(free_port())
        with ServerProcess(**env, MODEL_STORE=str(tiny_store)) as server:
            assert server.readiness()[0] == 200, service
