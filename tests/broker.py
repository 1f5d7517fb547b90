"""Broker mode for real: a redis-server of the test's own on 127.0.0.1, model workers
(``python -m app.broker.worker``) and front ends as separate processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from app.broker.wire.keys import HEARTBEAT_S, STALE_S
from app.broker.wire.parsing import text
from app.broker.worker.consumer import RECLAIM_S
from tests.children import start
from tests.server import ChildProcess, free_port

PREFIX = "mbtest"
# A batch that outlasts a heartbeat (one every HEARTBEAT_S), for the slow test model: a
# heartbeat shows the batch running, and a test that looks for it (every 0.1 s or so) acts
# on it before the batch ends.
OUTLASTS_A_HEARTBEAT_S = 2 * HEARTBEAT_S
# How much longer than alone a batch may take while workers (one of them loading again after
# a kill), a front end and the test share the cores: with another test run beside it on 2
# cores, the kill test's batches took twice as long.
SHARED_CORES_SLOWDOWN = 2.0


def recovery_s(batch_s: float, entries: int) -> float:
    """The longest the ``entries`` of a worker killed mid-batch wait for their answers when
    a batch takes ``batch_s`` alone: its heartbeat goes stale (STALE_S), a survivor's next
    look for orphans (every RECLAIM_S) finds them once its own batch ended, and it runs them
    one at a time (a poison input among them takes no batch-mate with it), each batch up to
    SHARED_CORES_SLOWDOWN times slower than alone."""
    return STALE_S + RECLAIM_S + (1 + entries) * SHARED_CORES_SLOWDOWN * batch_s


def require_redis_server() -> str:
    """The redis-server binary; the test skips without one, except where CI demands it
    (``.ci/run`` installs it and sets ``CI_REQUIRE_REDIS=1``)."""
    binary = shutil.which("redis-server")
    if binary is None:
        message = (
            "redis-server is not installed (make test installs it: apt-get install redis-server)"
        )
        if os.environ.get("CI_REQUIRE_REDIS"):
            pytest.fail(message)
        pytest.skip(message)
    return binary


@dataclass(frozen=True)
class TlsFiles:
    """A CA, a certificate for 127.0.0.1 signed by it, and a client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def client_options(self) -> dict[str, object]:
        """redis-py's keyword arguments for a client that checks the server and shows its own."""
        return {"ssl": True, "ssl_ca_certs": str(self.ca), "ssl_certfile": str(self.client_cert),
                "ssl_keyfile": str(self.client_key)}  # fmt: skip

    def url_options(self) -> str:
        """redis-py's query options for a client that checks the server and shows its own."""
        return (
            f"ssl_ca_certs={self.ca}&ssl_certfile={self.client_cert}&ssl_keyfile={self.client_key}"
        )


def make_tls_files(folder: Path) -> TlsFiles:
    """Certificates made now with the openssl command (skips the test where it is missing)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make test certificates")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "1", "-subj", "/CN=microbatch-test-ca")  # fmt: skip
    (folder / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for name, extra in (("server", ["-extfile", "san.cnf"]), ("client", [])):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
            f"{name}.csr", "-subj", f"/CN={name}")  # fmt: skip
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", *extra)  # fmt: skip
    return TlsFiles(
        folder / "ca.pem",
        folder / "server.pem",
        folder / "server.key",
        folder / "client.pem",
        folder / "client.key",
    )


class RedisServer:
    """A throwaway redis-server (no persistence) on a free port; ``stop()`` and ``start()``
    simulate an outage, after which it comes back empty, as a Redis without persistence
    does after a restart. With ``tls``, it listens for TLS only, and asks for a client
    certificate; ``url`` carries the client's files."""

    def __init__(self, tls: TlsFiles | None = None) -> None:
        self.binary = require_redis_server()
        self.port = free_port()
        self.tls = tls
        self.url = f"redis://127.0.0.1:{self.port}/0"
        if tls is not None:
            self.url = f"rediss://127.0.0.1:{self.port}/0?{tls.url_options()}"
        self.dir = tempfile.mkdtemp(prefix="mbtest-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    def _listen(self) -> list[str]:
        if self.tls is None:
            return ["--port", str(self.port)]
        return ["--port", "0", "--tls-port", str(self.port),
                "--tls-cert-file", str(self.tls.server_cert),
                "--tls-key-file", str(self.tls.server_key),
                "--tls-ca-cert-file", str(self.tls.ca)]  # fmt: skip

    def start(self) -> RedisServer:
        self.process = start(
            [
                self.binary,
                *self._listen(),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", self.dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = self.client()
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise AssertionError("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def broker_env(redis_url: str, store: Path, **env: str) -> dict[str, str]:
    return {
        "MB_BROKER": redis_url,
        "MB_BROKER_PREFIX": PREFIX,
        "MODEL_STORE": str(store),
        "CUDA_DEVICES": "cpu",
        "LOG_LEVEL": "warning",
        **env,
    }


class Workers(ChildProcess):
    """``python -m app.broker.worker`` (or another script, for fault injection) with its env;
    started and waited for until ``count`` workers heartbeat through Redis, their first
    loads ended."""

    name = "workers"
    own_group = True

    def __init__(
        self,
        redis_server: RedisServer,
        store: Path,
        *,
        count: int = 1,
        command: list[str] | None = None,
        environment: Mapping[str, str] | None = None,
        **env: str,
    ) -> None:
        self.redis = redis_server
        self.count = count
        self.command = command or [sys.executable, "-m", "app.broker.worker"]
        self.env = {
            **os.environ,
            **broker_env(redis_server.url, store, MB_WORKER_NUM=str(count), MB_WORKER_THREADS="1"),
            **(environment or {}),
            **env,
        }
        self.process: subprocess.Popen[str] | None = None
        self.output = ""

    def start(self, timeout_s: float = 90) -> Workers:
        self.spawn(self.command, self.env)
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while not self.started():
            if self.process.poll() is not None:
                self._collect()
                raise AssertionError(f"workers exited during start:\n{self.output}")
            if time.monotonic() > deadline:
                self.stop(signal.SIGKILL)  # nothing of it outlives the failed start
                raise AssertionError(f"workers never started:\n{self.output}")
            time.sleep(0.1)
        return self

    def started(self) -> bool:
        """Whether each of the ``count`` workers heartbeats and its first loads ended (a
        worker starts holding nothing, and loads as at any load: its heartbeat says each
        version loading, then ready or failed)."""
        own = self.own()
        return len(own) >= self.count and all(
            beat["models"] and all(m["state"] != "loading" for m in beat["models"])
            for beat in own.values()
        )

    def now_ms(self) -> int:
        """Redis's clock, which stamps the heartbeats."""
        seconds, micros = self.redis.client().time()
        return int(seconds) * 1000 + int(micros) // 1000

    @contextmanager
    def paused(self, worker: Mapping[str, Any]) -> Iterator[None]:
        """``worker`` (a ``live()`` value) stopped (SIGSTOP) as if busy with a long batch,
        resumed (SIGCONT) on leaving; its heartbeat kept fresh meanwhile (``beating``)."""
        os.kill(worker["pid"], signal.SIGSTOP)
        try:
            with self.beating(worker):
                yield
        finally:
            os.kill(worker["pid"], signal.SIGCONT)

    @contextmanager
    def beating(self, worker: Mapping[str, Any]) -> Iterator[None]:
        """``worker``'s heartbeat kept fresh by the test, as a busy worker's own heartbeat
        thread keeps it: the front ends count it live however long the test takes on a busy
        host, whatever keeps the worker from beating itself."""
        done = threading.Event()

        def beat() -> None:
            client = self.redis.client()
            while not done.wait(HEARTBEAT_S / 2):
                client.zadd(f"{PREFIX}:{{w}}:workers", {worker["name"]: self.now_ms()})

        beating = threading.Thread(target=beat, daemon=True)
        beating.start()
        try:
            yield
        finally:
            done.set()
            beating.join()

    def beat_since(self, since_ms: int) -> bool:
        """Whether each of the ``count`` workers has sent a heartbeat stamped after
        ``since_ms``: it then holds every batch the worker had answered by that moment (a
        worker counts a batch before it sends the replies)."""
        client = self.redis.client()
        beats = client.zrangebyscore(f"{PREFIX}:{{w}}:workers", since_ms + 1, self.now_ms() + 1)
        return len(beats) >= self.count

    def live(self) -> dict[str, dict[str, Any]]:
        """The workers with a fresh heartbeat, by name, as Redis has them."""
        import json

        client = self.redis.client()
        seconds, micros = client.time()
        now_ms = seconds * 1000 + micros // 1000
        names = client.zrangebyscore(f"{PREFIX}:{{w}}:workers", now_ms - 3000, "+inf")
        if not names:
            return {}
        infos = client.hmget(f"{PREFIX}:{{w}}:worker-info", [text(n) for n in names])
        return {
            text(name): json.loads(info) for name, info in zip(names, infos, strict=True) if info
        }

    def own(self) -> dict[str, dict[str, Any]]:
        """The live workers of this supervisor's host (its ``MB_WORKER_NAME``; every live
        worker when it has none): another host's heartbeats say nothing of this one."""
        host = self.env.get("MB_WORKER_NAME")
        return {n: beat for n, beat in self.live().items() if host in (None, beat["host"])}

    def __enter__(self) -> Workers:
        return self.start()


def stream_key(store: Path, task: str) -> str:
    """The stream the workers of ``store``'s export read ``task`` requests from."""
    from app.manifest import read_manifest

    return f"{PREFIX}:{{q}}:{read_manifest(store).version}:{task}"


def lane_entries(redis_server: RedisServer, task: str, tenant: str) -> int:
    """How many entries ``tenant``'s lanes of ``task`` have ever been given, over every
    export and level (read or not: a stream counts what was added to it)."""
    client = redis_server.client()
    return sum(
        int(client.xinfo_stream(lane)["entries-added"])
        for lane in client.scan_iter(f"{PREFIX}:{{q}}:*:{task}:p*:{tenant}")
    )


def stream_state(redis_server: RedisServer) -> dict[str, tuple[int, int]]:
    """Each task's (entries, entries pending in the consumer group), over every export."""
    client = redis_server.client()
    state = {}
    for task in ("tag", "embedding"):
        length = pending = 0
        for stream in client.scan_iter(f"{PREFIX}:{{q}}:*:{task}"):
            length += client.xlen(stream)
            pending += sum(int(group["pending"]) for group in client.xinfo_groups(stream))
        state[task] = (length, pending)
    return state
