"""Broker mode under an autoscaler: the backlog a front end reports (what KEDA scales the
workers on), workers scaled to zero and back (``MB_SCALE_FROM_ZERO``), and the worker
host's probes (``MB_HEALTH_PORT``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.broker.front.transport import BrokerTransport
from app.broker.wire.keys import GROUP, Keys
from app.broker.worker.probes import Probes, Running
from app.broker.worker.probes import client_for as probes_client
from app.jobs import Task
from app.lifecycle import Route
from tests.answers import error_of
from tests.broker import PREFIX, RedisServer, Workers, broker_env
from tests.conftest import distinct_images
from tests.integration.test_broker import front_end, post
from tests.server import free_port
from tests.waiting import wait_for

pytestmark = pytest.mark.slow


async def test_the_backlog_sums_lag_and_pending_over_the_served_versions_streams() -> None:
    """Over the streams of every routed version: unread entries count as lag, read and
    unanswered ones as pending, a stream no worker joined yet counts whole; once an unread
    entry is deleted Redis cannot tell the lag, and the entries not pending count instead. A
    version nobody routes to or holds does not count (nothing will compute its entries)."""
    with RedisServer() as redis_server:
        client = redis_server.client()
        keys = Keys(PREFIX)
        read = keys.stream("m@aaaaaaaaaaaa", Task.TAG)
        fresh = keys.stream("n@bbbbbbbbbbbb", Task.EMBEDDING)
        stale = keys.stream("m@cccccccccccc", Task.TAG)
        client.xgroup_create(read, GROUP, id="0", mkstream=True)
        ids = [client.xadd(read, {"h": b"x"}) for _ in range(5)]
        client.xreadgroup(GROUP, "w:0", {read: ">"}, count=2)  # 2 pending, 3 unread
        for _ in range(4):
            client.xadd(fresh, {"h": b"x"})  # no group yet: workers at zero
            client.xadd(stale, {"h": b"x"})  # an old version's leftovers
        transport = BrokerTransport(redis_server.url, PREFIX, max_queue=100)
        await transport.start()
        transport.monitor.routes = {
            "m": Route(1, "m@aaaaaaaaaaaa"),
            "n": Route(1, "n@bbbbbbbbbbbb"),
        }
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


async def _queue(base_url: str, images: list[bytes]) -> list[asyncio.Task[httpx.Response]]:
    return [
        asyncio.create_task(post(base_url, "/predict/embedding", image, timeout=60))
        for image in images
    ]


def png_of(seed: int) -> bytes:
    return distinct_images(1 + seed)[seed]


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
            await wait_for(lambda: not front.readiness()[1]["workers"], what="no worker seen")
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


async def test_a_front_end_scaling_from_zero_queues_before_any_worker_ever_ran(
    tiny_store: Path,
) -> None:
    """A fresh install scaled to zero: no worker ever ran and Redis holds no routes; the
    front end routes by its own repository's choice, is ready, and queues; the first worker
    answers with that very export."""
    from app.manifest import read_manifest

    images = distinct_images(3)
    with RedisServer() as redis_server:
        with front_end(redis_server, tiny_store, MB_SCALE_FROM_ZERO="1") as front:
            assert front.readiness()[0] == 200
            waiting = await _queue(front.base_url, images)
            await wait_for(lambda: _backlog(front.base_url)["lag"] == 3, what="lag 3")
            with Workers(redis_server, tiny_store, count=1):
                answers = await asyncio.gather(*waiting)
                await wait_for(lambda: _backlog(front.base_url)["backlog"] == 0, what="0")
    assert [a.status_code for a in answers] == [200] * 3
    own = f"tiny-test@{read_manifest(tiny_store).version}"
    assert {a.headers["X-Model-Id"] for a in answers} == {own}


async def test_requests_for_a_version_gone_while_at_zero_are_refused_and_leave_nothing(
    tmp_path: Path,
) -> None:
    """Requests queued with no worker for version 1; version 2 appears on disk, and the
    worker that comes serves version 2 only: the front end answers the waiting requests
    503 as soon as the name moves, deletes their entries, and the backlog falls to 0 (a
    stale version's leftovers must not keep an autoscaler up)."""
    from tests.broker import stream_key
    from tests.models import export_scaled, export_tiny

    repository = tmp_path / "models"
    v1 = export_tiny(repository / "tiny" / "1")
    env = {"MODEL_REPOSITORY": str(repository), "MB_SCALE_FROM_ZERO": "1"}
    with RedisServer() as redis_server:
        with front_end(redis_server, v1, **env) as front:
            with Workers(redis_server, v1, count=1, MODEL_REPOSITORY=str(repository)):
                assert (await post(front.base_url, "/predict/embedding", png_of(1))).is_success
            await wait_for(lambda: not front.readiness()[1]["workers"], what="no worker seen")
            waiting = await _queue(front.base_url, [png_of(i) for i in range(2, 5)])
            await wait_for(lambda: _backlog(front.base_url)["lag"] == 3, what="lag 3")
            staged = export_scaled(tmp_path / "staged", 2.0)
            staged.rename(repository / "tiny" / "2")
            with Workers(redis_server, v1, count=1, MODEL_REPOSITORY=str(repository)):
                answers = await asyncio.gather(*waiting)
                await wait_for(lambda: _backlog(front.base_url)["backlog"] == 0, what="0")
                left = redis_server.client().xlen(stream_key(v1, "embedding"))
    assert [a.status_code for a in answers] == [503] * 3
    assert {error_of(a)["type"] for a in answers} == {"worker_died"}
    assert left == 0


async def test_without_scale_from_zero_routes_are_not_kept(tiny_store: Path) -> None:
    with RedisServer() as redis_server, Workers(redis_server, tiny_store, count=1):
        with front_end(redis_server, tiny_store) as front:
            ok = await post(front.base_url, "/predict/embedding", distinct_images(1)[0])
            assert ok.status_code == 200
            assert redis_server.client().exists(f"{PREFIX}:routes") == 0


def _probe(port: int, path: str) -> tuple[int, dict[str, Any]]:
    answer = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)
    return answer.status_code, answer.json()


def test_the_worker_probes_answer_from_the_heartbeats(tiny_store: Path) -> None:
    """The worker command's health port: ready once its worker serves (naming it), live,
    404 elsewhere; liveness reads the age of each worker's heartbeat thread from memory the
    worker shares with its supervisor: a worker stopped (SIGSTOP) ages there, and is young
    again once it goes on."""
    port = free_port()
    with RedisServer() as redis_server:
        workers = Workers(redis_server, tiny_store, count=1, MB_HEALTH_PORT=str(port))
        workers.start()
        try:
            deadline = time.monotonic() + 30
            while _probe(port, "/readyz")[0] != 200:
                assert time.monotonic() < deadline, "never ready"
                time.sleep(0.2)
            name, beat = next(iter(workers.own().items()))
            assert _probe(port, "/readyz")[1]["workers"] == [name]
            assert _probe(port, "/nope")[0] == 404
            # The heartbeat in Redis (readiness) comes first; its thread's first turn just after.
            deadline = time.monotonic() + 10
            while name not in (body := _probe(port, "/healthz")[1])["heartbeat_age_s"]:
                assert time.monotonic() < deadline, body
                time.sleep(0.2)
            assert body["status"] == "ok" and body["heartbeat_age_s"][name] < 2.5, body
            os.kill(beat["pid"], signal.SIGSTOP)
            try:
                time.sleep(4)
                status, body = _probe(port, "/healthz")
                assert status == 200 and body["heartbeat_age_s"][name] >= 3, body
            finally:
                os.kill(beat["pid"], signal.SIGCONT)
            deadline = time.monotonic() + 10  # its heartbeat thread turns again at once
            while (body := _probe(port, "/healthz")[1])["heartbeat_age_s"][name] >= 2.5:
                assert time.monotonic() < deadline, body
                time.sleep(0.2)
        finally:
            workers.stop()


def test_the_probes_rules() -> None:
    """On a Redis of their own: a fresh heartbeat, sent by the worker's own process, with a
    model ready is ready; aged, or another process's, it is not. Liveness asks nothing of
    Redis: it fails for a loaded worker whose heartbeat thread has been silent past the limit
    and for a supervisor loop that stopped turning, never for a worker still loading, nor for
    Redis being away."""
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
        running = [Running("h:0", pid=1, alive=True, loaded=True, silent_s=0.5)]
        turned = time.monotonic()
        probes = Probes(
            probes_client(redis_server.url), keys, lambda: running, lambda: turned, lambda: False
        )
        assert probes.readiness().status == 200, probes.readiness()
        assert probes.liveness().status == 200
        running = [Running("h:0", pid=2, alive=True, loaded=True)]  # another process's name
        assert probes.readiness().status == 503
        running = [Running("h:0", pid=1, alive=True, loaded=True, silent_s=0.5)]
        client.zadd(keys.heartbeats, {"h:0": now_ms - 31_000})  # Redis took none lately
        assert probes.readiness().status == 503
        assert probes.liveness().status == 200
        running = [Running("h:0", pid=1, alive=True, loaded=True, silent_s=31)]
        assert probes.liveness().status == 503
        assert "h:0" in str(probes.liveness().body["reason"])
        running = [Running("h:0", pid=1, alive=True, loaded=False, silent_s=31)]  # loading
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

    from tests.children import dies_with_run
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
            preexec_fn=dies_with_run(),
        )  # fmt: skip
    assert done.returncode == 2
    assert f"health port {port}" in done.stderr
