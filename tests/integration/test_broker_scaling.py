"""Broker mode under an autoscaler: the backlog a front end reports (what KEDA scales the
workers on), workers scaled to zero and back (``MB_SCALE_FROM_ZERO``), and the worker
host's probes (``MB_HEALTH_PORT``)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import pytest

from app.broker.keys import GROUP, Keys
from app.broker.probes import Probes, Running
from app.broker.probes import client_for as probes_client
from app.broker.transport import BrokerTransport
from tests.broker import PREFIX, RedisServer, Workers, broker_env
from tests.conftest import distinct_images
from tests.integration.test_broker import front_end, post, wait_for
from tests.server import free_port

pytestmark = pytest.mark.slow


async def test_the_backlog_sums_lag_and_pending_over_every_versions_streams() -> None:
    """Unread entries count as lag, read and unanswered ones as pending, a stream no worker
    joined yet counts whole; once an unread entry is deleted Redis cannot tell the lag, and
    the entries not pending count instead."""
    with RedisServer() as redis_server:
        client = redis_server.client()
        keys = Keys(PREFIX)
        read, fresh = f"{PREFIX}:{{q}}:aaaaaaaaaaaa:tag", f"{PREFIX}:{{q}}:bbbbbbbbbbbb:embedding"
        client.xgroup_create(read, GROUP, id="0", mkstream=True)
        ids = [client.xadd(read, {"h": b"x"}) for _ in range(5)]
        client.xreadgroup(GROUP, "w:0", {read: ">"}, count=2)  # 2 pending, 3 unread
        for _ in range(4):
            client.xadd(fresh, {"h": b"x"})  # no group yet: workers at zero
        client.set(f"{PREFIX}:{{q}}:not-a-stream", b"1")
        transport = BrokerTransport(redis_server.url, PREFIX, max_queue=100)
        await transport.start()
        try:
            backlog = await transport.backlog()
            assert (backlog.lag, backlog.pending, backlog.backlog) == (7, 2, 9)
            assert {s.stream: (s.group, s.lag, s.pending) for s in backlog.streams} == {
                read: (GROUP, 3, 2),
                fresh: (None, 4, 0),
            }
            client.xdel(read, ids[-1])  # a caller gave up on an unread entry
            assert client.xinfo_groups(read)[0]["lag"] is None
            backlog = await transport.backlog()
            assert (backlog.lag, backlog.pending) == (2 + 4, 2)
        finally:
            await transport.aclose()
        assert keys.all_streams == f"{PREFIX}:{{q}}:*"


async def _queue(base_url: str, images: list[bytes]) -> list[asyncio.Task[httpx.Response]]:
    return [
        asyncio.create_task(post(base_url, "/predict/embedding", image, timeout=60))
        for image in images
    ]


def _backlog(base_url: str) -> dict[str, int]:
    answer = httpx.get(f"{base_url}/backlog", timeout=5)
    assert answer.status_code == 200, answer.text
    counts: dict[str, int] = answer.json()
    return counts


async def test_workers_scaled_to_zero_and_back_lose_nothing(tiny_store: Path) -> None:
    """With ``MB_SCALE_FROM_ZERO``, a front end stays ready with no worker; requests queue
    for the version last served, /backlog counts them, and workers that come back answer
    every one; a front end started while there are none routes by the routes in Redis."""
    images = distinct_images(12)
    with RedisServer() as redis_server:
        workers = Workers(redis_server, tiny_store, count=1).start()
        with front_end(redis_server, tiny_store, MB_SCALE_FROM_ZERO="1") as front:
            first = await post(front.base_url, "/predict/embedding", images[0])
            assert first.status_code == 200
            served = first.headers["X-Model-Id"]
            await wait_for(
                lambda: redis_server.client().hlen(f"{PREFIX}:routes") == 1, what="routes kept"
            )
            workers.stop()  # scaled to zero
            await wait_for(lambda: not workers.live(), what="no live worker")
            assert front.readiness()[0] == 200
            with front_end(redis_server, tiny_store, MB_SCALE_FROM_ZERO="1") as late:
                assert late.readiness()[0] == 200  # routes from Redis, no worker seen
                waiting = await _queue(front.base_url, images[1:7])
                waiting += await _queue(late.base_url, images[7:])
                await wait_for(lambda: _backlog(front.base_url)["lag"] == 11, what="lag 11")
                assert _backlog(late.base_url)["backlog"] == 11
                await asyncio.sleep(1)
                assert not any(task.done() for task in waiting)
                workers = Workers(redis_server, tiny_store, count=1).start()  # scaled up
                try:
                    answers = await asyncio.gather(*waiting)
                    await wait_for(lambda: _backlog(front.base_url)["backlog"] == 0, what="0")
                finally:
                    workers.stop()
    assert [a.status_code for a in answers] == [200] * 11
    assert {a.headers["X-Model-Id"] for a in answers} == {served}


async def test_without_scale_from_zero_routes_are_not_kept(tiny_store: Path) -> None:
    with RedisServer() as redis_server, Workers(redis_server, tiny_store, count=1):
        with front_end(redis_server, tiny_store) as front:
            ok = await post(front.base_url, "/predict/embedding", distinct_images(1)[0])
            assert ok.status_code == 200
            assert redis_server.client().exists(f"{PREFIX}:routes") == 0


def _probe(port: int, path: str) -> tuple[int, dict[str, object]]:
    answer = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)
    return answer.status_code, answer.json()


def test_the_worker_probes_answer_from_the_heartbeats(tiny_store: Path) -> None:
    """The worker command's health port: ready once its worker serves (naming it), live,
    404 elsewhere."""
    port = free_port()
    with RedisServer() as redis_server:
        workers = Workers(redis_server, tiny_store, count=1, MB_HEALTH_PORT=str(port))
        workers.start()
        try:
            deadline = time.monotonic() + 30
            while _probe(port, "/readyz")[0] != 200:
                assert time.monotonic() < deadline, "never ready"
                time.sleep(0.2)
            _, body = _probe(port, "/readyz")
            assert body["workers"] == [next(iter(workers.own()))]
            assert _probe(port, "/healthz")[0] == 200
            assert _probe(port, "/nope")[0] == 404
        finally:
            workers.stop()


def test_liveness_fails_for_a_loaded_worker_whose_heartbeat_went_silent() -> None:
    """The probes' rules on a Redis of their own: a fresh heartbeat with a model ready is
    ready and live; the same heartbeat aged past the limits is neither; a worker not loaded
    yet is not judged by liveness; Redis away keeps liveness 200 (restarting would not help)."""
    with RedisServer() as redis_server:
        client = redis_server.client()
        keys = Keys(PREFIX)
        info = {
            "name": "h:0", "host": "h", "index": 0, "pid": 1, "device": "cpu", "threads": 1,
            "batch_size": 8, "ready": True, "alive": True, "running": 0, "restarts": 0,
            "batches": 0, "items": 0, "mixed_batches": 0, "expired": 0, "malformed": 0,
            "reclaimed": 0, "given_up": 0,
            "models": [{"name": "m", "version": 1, "served_id": "m@aaaaaaaaaaaa",
                        "state": "ready"}],
        }  # fmt: skip
        seconds, micros = client.time()
        now_ms = seconds * 1000 + micros // 1000
        client.zadd(keys.heartbeats, {"h:0": now_ms})
        client.hset(keys.worker_info, "h:0", json.dumps(info))
        running = [Running("h:0", pid=1, alive=True, loaded=True)]
        turned = time.monotonic()
        probes = Probes(
            probes_client(redis_server.url), keys, lambda: running, lambda: turned, lambda: False
        )
        assert probes.readiness().status == 200, probes.readiness()
        running = [Running("h:0", pid=2, alive=True, loaded=True)]  # another process's name
        assert probes.readiness().status == 503
        running = [Running("h:0", pid=1, alive=True, loaded=True)]
        assert probes.liveness().status == 200
        client.zadd(keys.heartbeats, {"h:0": now_ms - 31_000})
        assert probes.readiness().status == 503
        assert probes.liveness().status == 503
        assert "h:0" in str(probes.liveness().body["reason"])
        running = [Running("h:0", pid=1, alive=True, loaded=False)]  # loading: startup probe's job
        assert probes.liveness().status == 200
        turned = time.monotonic() - 60  # the supervisor's loop stopped turning
        assert probes.liveness().status == 503
        turned = time.monotonic()
        redis_server.stop()
        assert probes.liveness().status == 200
        assert probes.readiness().status == 503


def test_the_worker_command_refuses_a_health_port_in_use(tiny_store: Path) -> None:
    import socket
    import subprocess
    import sys

    from tests.server import REPO

    with socket.socket() as taken, RedisServer() as redis_server:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {
            **os.environ,
            **broker_env(redis_server.url, tiny_store),
            "MB_HEALTH_PORT": str(port),
        }
        done = subprocess.run(
            [sys.executable, "-m", "app.broker.worker"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 2
    assert f"health port {port}" in done.stderr
