"""No process outlives what supervises it, even under ``kill -9``; one live process per broker
worker name. The orphan case of the issue: a worker supervisor killed with -9 left its model
worker consuming, heartbeating under the name its replacement then took."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import psutil
import pytest

from app.broker.wire.parsing import text
from app.workers.lineage import stop_child
from tests.broker import PREFIX, RedisServer, Workers, broker_env
from tests.children import start
from tests.server import REPO, ServerProcess, alive, free_port

pytestmark = pytest.mark.slow

GONE_WITHIN_S = 2.0


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive ``seconds`` from now (polling: none, as soon as all are gone)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [pid for pid in pids if alive(pid)]
        if not left:
            return []
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


def test_a_child_dies_with_its_parent_and_a_late_one_exits_at_once(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", (
            "import os, sys, time; from app.workers.lineage import die_with_parent; "
            f"die_with_parent({os.getpid()}); print('guarded', flush=True); time.sleep(60)"
        )], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline() == "guarded\\n"
        print(child.pid, flush=True)
        time.sleep(60)
        """
    )
    with start(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True
    ) as parent:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
    assert gone_within([child], GONE_WITHIN_S) == []
    # A parent that died before the child could ask: the child sees it and exits.
    late = subprocess.run(
        [sys.executable, "-c", "from app.workers.lineage import die_with_parent; "
         "die_with_parent(1); print('still here')"],
        cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert late.returncode == 1 and "still here" not in late.stdout


def test_stop_child_terminates_and_kills_one_that_ignores_sigterm() -> None:
    polite = start([sys.executable, "-c", "import time; time.sleep(60)"])
    assert stop_child(polite, timeout_s=10) == -signal.SIGTERM
    stubborn = start(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
         "signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert stubborn.stdout is not None and stubborn.stdout.readline() == "ready\n"
    started = time.monotonic()
    assert stop_child(stubborn, timeout_s=0.5) == -signal.SIGKILL
    assert time.monotonic() - started < 5
    stubborn.stdout.close()


def test_the_model_workers_die_within_two_seconds_of_their_server(tiny_store: Path) -> None:
    with ServerProcess(MODEL_STORE=str(tiny_store), MB_WORKER_NUM="2") as server:
        workers = server.worker_pids()
        assert len(workers) == 2
        server.stop(signal.SIGKILL)
    assert gone_within(workers, GONE_WITHIN_S) == []


def _worker_beats(redis_server: RedisServer) -> dict[str, dict[str, object]]:
    client = redis_server.client()
    infos = client.hgetall(f"{PREFIX}:{{w}}:worker-info")
    return {text(name): json.loads(raw) for name, raw in infos.items()}


def test_a_supervisor_killed_takes_its_worker_and_its_name_frees_for_the_next(
    tiny_store: Path,
) -> None:
    """The orphan case: kill -9 of ``python -m app.broker.worker`` used to leave its model
    worker consuming for good. It dies with its supervisor now, and a supervisor started
    again under the same name takes the name over (its worker's heartbeat, its pid)."""
    with RedisServer() as redis_server:
        first = Workers(redis_server, tiny_store, count=1, MB_WORKER_NAME="solo").start()
        (old_pid,) = [p.pid for p in psutil.Process(first.process.pid).children()  # type: ignore[union-attr]
                      if "resource_tracker" not in " ".join(p.cmdline())]  # fmt: skip
        first.stop(signal.SIGKILL)
        assert gone_within([old_pid], GONE_WITHIN_S) == []
        with Workers(redis_server, tiny_store, count=1, MB_WORKER_NAME="solo") as second:
            deadline = time.monotonic() + 30
            while _worker_beats(redis_server).get("solo:0", {}).get("pid") == old_pid:
                assert time.monotonic() < deadline, "the new worker never took its name"
                time.sleep(0.1)
            (new_pid,) = [p.pid for p in psutil.Process(second.process.pid).children()  # type: ignore[union-attr]
                          if "resource_tracker" not in " ".join(p.cmdline())]  # fmt: skip
            assert _worker_beats(redis_server)["solo:0"]["pid"] == new_pid


def test_a_second_process_under_a_live_workers_name_does_not_join(tiny_store: Path) -> None:
    """Two supervisors with one MB_WORKER_NAME: the second's worker refuses to consume under
    the name while the first's lives (and says why); it takes over once the first is gone."""
    with (
        RedisServer() as redis_server,
        Workers(redis_server, tiny_store, count=1, MB_WORKER_NAME="twin") as first,
    ):
        holder = _worker_beats(redis_server)["twin:0"]["pid"]
        env = {**os.environ, **broker_env(redis_server.url, tiny_store, MB_WORKER_NAME="twin",
                                          MB_WORKER_NUM="1", MB_WORKER_THREADS="1")}  # fmt: skip
        log_path = Path(redis_server.dir) / "second.log"
        with log_path.open("w") as log:
            second = start(
                [sys.executable, "-m", "app.broker.worker"], own_group=True, cwd=REPO, env=env,
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while "held by a live process" not in log_path.read_text():
                assert time.monotonic() < deadline, log_path.read_text()
                assert _worker_beats(redis_server)["twin:0"]["pid"] == holder
                time.sleep(0.2)
            assert _worker_beats(redis_server)["twin:0"]["pid"] == holder
            first.stop(signal.SIGTERM)
            deadline = time.monotonic() + 60
            while _worker_beats(redis_server).get("twin:0", {}).get("pid") in (None, holder):
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.2)
        finally:
            os.killpg(second.pid, signal.SIGTERM)
            second.wait(timeout=90)
        assert f"pid {holder}" in log_path.read_text()


def test_a_cluster_killed_takes_every_process_with_it(tiny_store: Path) -> None:
    """kill -9 of ``python -m app.broker.cluster``: Redis, the gunicorn master and its front
    ends, the worker supervisor and its workers all stop on their own."""
    port = free_port()
    env = {**os.environ, **broker_env("unused", tiny_store), "HOST": "127.0.0.1",
           "PORT": str(port), "MB_WORKER_THREADS": "1"}  # fmt: skip
    env.pop("MB_BROKER")
    launcher = start(
        [sys.executable, "-m", "app.broker.cluster", "--redis-port", str(free_port())],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            family = psutil.Process(launcher.pid).children(recursive=True)
            roles = " ".join(" ".join(p.cmdline()) for p in family)
            if "redis-server" in roles and "gunicorn" in roles and roles.count("spawn_main") >= 2:
                break
            assert time.monotonic() < deadline, roles
            time.sleep(0.2)
        time.sleep(1.0)
        family = [p.pid for p in psutil.Process(launcher.pid).children(recursive=True)]
        launcher.kill()
        launcher.wait()
        assert gone_within(family, 10.0) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_every_process_a_test_starts_dies_with_the_test_run(tiny_store: Path) -> None:
    """However the test run ends (pytest's timeout ends it with ``os._exit``, CI with
    ``kill -9``, and no clean-up runs), nothing it started is left: a process that plays the
    test run starts what tests start, Redis, a worker supervisor and a server, the server
    from a thread that has ended by then (as ``asyncio.to_thread`` does), and a process group
    whose member does not watch its parent (as ``uvicorn --workers``' do) under its guard,
    and is killed with -9. Every process under it, the supervisor's and the server's
    workers too, goes."""
    script = textwrap.dedent(
        """
        import json, sys, threading, time
        from pathlib import Path
        from tests.broker import RedisServer, Workers
        from tests.children import group_guard, start
        from tests.server import ServerProcess
        store = Path(sys.argv[1])
        redis_server = RedisServer().start()
        workers = Workers(redis_server, store, count=1).start()
        server = ServerProcess(MODEL_STORE=str(store), MB_WORKER_NUM="1")
        starting = threading.Thread(target=server.start)
        starting.start()
        starting.join()
        loose = start(["sh", "-c", "sleep 600 & wait"], own_group=True)
        with group_guard(loose):
            print(json.dumps({
                "redis": redis_server.process.pid, "redis_dir": redis_server.dir,
                "supervisor": workers.process.pid, "server": server.pid, "loose": loose.pid,
                "url": server.base_url,
            }), flush=True)
            time.sleep(600)
        """
    )
    with start(
        [sys.executable, "-c", script, str(tiny_store)], cwd=REPO, stdout=subprocess.PIPE,
        text=True,
    ) as test_run:  # fmt: skip
        try:
            assert test_run.stdout is not None
            line = test_run.stdout.readline()
            assert line, f"the test run exited ({test_run.wait()}) before it started them all"
            started = json.loads(line)
            roles = ("supervisor", "server", "loose")  # each with a child of its own, soon
            deadline = time.monotonic() + 10  # the loose shell forks its sleep when it runs
            while True:
                family = psutil.Process(test_run.pid).children(recursive=True)
                parents = {p.pid: p.ppid() for p in family}
                childless = [r for r in roles if started[r] not in parents.values()]
                if not childless or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            for role in ("redis", "supervisor", "server", "loose"):
                assert parents[started[role]] == test_run.pid, role
            assert not childless, f"without a child: {childless}"
            # The server outlived the thread that started it.
            assert httpx.get(f"{started['url']}/readyz", timeout=5).status_code == 200
        finally:
            test_run.kill()
            test_run.wait()
    assert gone_within(list(parents), 5.0) == []
    shutil.rmtree(started["redis_dir"], ignore_errors=True)
