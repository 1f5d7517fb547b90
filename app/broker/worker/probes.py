"""A broker worker host's probes, for the kubelet or any supervisor: with ``MB_HEALTH_PORT``,
``python -m app.broker.worker`` answers ``GET /healthz`` (liveness) and ``GET /readyz``
(readiness, and the startup probe while models load) from what Redis says of this host's
workers, the very heartbeats front ends route by.

- ``/readyz``: 200 while one of this host's workers has a fresh heartbeat (younger than
  ``STALE_S``, sent by its own process) with a model ready and is not draining; 503
  otherwise (loading, Redis away, stopping, its name held by another process).
- ``/healthz``: 503 when the supervising loop has not turned for ``LOOP_STALL_S``, or when a
  worker that finished loading still runs but its heartbeat thread has not turned for
  ``SILENT_S`` (stopped, or hung with its interpreter held): restarting the pod is the cure.
  Liveness asks nothing of Redis (the thread marks each turn in memory it shares with the
  supervisor, whether Redis took the heartbeat or not): Redis away, or full and refusing
  writes, is not cured by restarting workers.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import redis
from redis.exceptions import RedisError

from app.broker.wire.connect import connect
from app.broker.wire.keys import Keys
from app.broker.wire.live import LiveWorkers
from app.lifecycle import VersionState

log = logging.getLogger("app.worker")

LOOP_STALL_S = 15.0  # the supervisor's loop turns every 0.2 s
SILENT_S = 30.0  # a loaded worker's heartbeat thread beats every second


@dataclass(frozen=True)
class Probe:
    """One answer: the HTTP status and its JSON body."""

    status: int
    body: dict[str, Any]


@dataclass(frozen=True)
class Running:
    """One of this host's workers as its supervisor sees it."""

    name: str
    pid: int | None  # its process (None before it starts)
    alive: bool  # its process runs
    loaded: bool  # its current life loaded its models
    silent_s: float | None = None  # since its heartbeat thread last turned (None: not yet)


class Probes:
    """The two answers, computed on demand (readiness: one Redis call, the live workers'
    view, ``app.broker.wire.live``; liveness: none). ``workers``, ``last_turn`` and ``stopping``
    come from the supervisor."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        workers: Callable[[], Sequence[Running]],
        last_turn: Callable[[], float],
        stopping: Callable[[], bool],
    ) -> None:
        self.client = client
        self.keys = keys
        self.workers = workers
        self.last_turn = last_turn
        self.stopping = stopping
        self._live = LiveWorkers(keys)

    def readiness(self) -> Probe:
        workers = self.workers()
        if self.stopping():
            return Probe(503, {"status": "stopping"})
        try:
            view = self._live.read(self.client)
        except (RedisError, OSError) as exc:
            return Probe(503, {"status": "not_ready", "reason": f"Redis: {exc}"})
        ready = []
        for worker in workers:
            info = view.worker(worker.name)
            if info is None or info.pid != worker.pid:  # stale, or another process's
                continue
            if not info.draining and any(m.state is VersionState.READY for m in info.models):
                ready.append(worker.name)
        if ready:
            return Probe(200, {"status": "ready", "workers": ready})
        return Probe(503, {"status": "not_ready", "reason": "no worker of this host serves yet"})

    def liveness(self) -> Probe:
        stalled_s = time.monotonic() - self.last_turn()
        if stalled_s > LOOP_STALL_S:
            return Probe(503, {"status": "stuck", "reason": f"supervisor idle {stalled_s:.0f} s"})
        workers = self.workers()
        silent = [
            w.name
            for w in workers
            if w.alive and w.loaded and w.silent_s is not None and w.silent_s > SILENT_S
        ]
        ages = {w.name: round(w.silent_s, 1) for w in workers if w.silent_s is not None}
        if silent:
            reason = f"no heartbeat for {SILENT_S:.0f} s from {', '.join(silent)}"
            return Probe(503, {"status": "stuck", "reason": reason, "heartbeat_age_s": ages})
        return Probe(200, {"status": "ok", "heartbeat_age_s": ages})


def serve(probes: Probes, port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Answer the probes on ``host:port`` from a daemon thread; returns the server (its
    ``shutdown()`` stops it)."""
    routes = {"/healthz": probes.liveness, "/readyz": probes.readiness}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            answer = routes.get(self.path.split("?", 1)[0])
            try:
                probe = answer() if answer else Probe(404, {"error": "not_found"})
            except Exception as exc:  # a probe that fails must say so, not hang
                log.exception("health probe failed")
                probe = Probe(503, {"status": "error", "reason": str(exc)[:200]})
            body = json.dumps(probe.body).encode()
            self.send_response(probe.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # probes are not news
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    log.info("health probes on %s:%d (/healthz, /readyz)", host, port)
    return server


def client_for(url: str) -> redis.Redis:
    """A Redis client for probes: short timeouts, so a probe answers within the kubelet's."""
    return connect(url, socket_timeout=2, socket_connect_timeout=2)
