"""The supervisor of a host's broker workers (``python -m app.broker.worker``): one process
per worker slot, restarted with backoff when it dies, told to stop on SIGTERM (each finishes
its batch and drains what only it holds), told to reload on SIGHUP; and the host's probes
(``MB_HEALTH_PORT``). It imports no torch and loads no model: only its children do."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import replace
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as EventType
from types import FrameType
from typing import Any

from app.broker.wire.keys import Keys
from app.broker.worker.probes import Probes, Running
from app.broker.worker.probes import client_for as probes_client
from app.broker.worker.probes import serve as serve_probes
from app.broker.worker.process import ConsumerSpec, consumer_main
from app.plan import BrokerPlan
from app.workers import allocator
from app.workers.backoff import RestartBackoff

log = logging.getLogger("app.worker")
signals = logging.getLogger("app.signals")  # each SIGHUP logged, however often (app.logs)

STABLE_S = 60.0  # a worker that ran this long before it died restarts without delay growth
STOP_TIMEOUT_S = 60.0  # a worker finishing its batch after SIGTERM gets this long


class Supervisor:
    """Keeps one process per spec running until told to stop."""

    def __init__(self, specs: list[ConsumerSpec]) -> None:
        self.specs = specs
        self.processes: dict[int, BaseProcess] = {}
        self.stopping = threading.Event()
        self._backoff = RestartBackoff()
        self._due: dict[int, float] = {}  # index -> when to restart it
        self._started: dict[int, float] = {}  # index -> when its current life began
        self._signalled: set[int] = set()  # pids told to stop
        self._exits: set[int | None] = set()  # pids whose exit was handled
        self._loaded: dict[int, EventType] = {}  # index -> set once its current life loaded
        self._beats: dict[int, Any] = {}  # index -> its current life's heartbeat-thread clock
        self.last_turn = time.monotonic()  # when the loop last turned (liveness)
        self.snapshot: tuple[Running, ...] = ()  # the workers, as of the last turn (probes)

    def _start(self, spec: ConsumerSpec) -> None:
        spec = replace(spec, parent_pid=os.getpid())
        context = mp.get_context("spawn")
        self._loaded[spec.index] = loaded = context.Event()
        self._beats[spec.index] = beat = context.Value("d", 0.0, lock=False)
        process = context.Process(
            target=consumer_main, args=(spec, loaded, beat), name=f"model-worker-{spec.index}"
        )
        # Started with SIGHUP blocked (the child unblocks it once it handles it): a SIGHUP
        # that reaches it sooner must not end it.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
        try:
            with allocator.for_children():
                process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
        self.processes[spec.index] = process
        self._started[spec.index] = time.monotonic()

    def _on_hangup(self, signum: int, frame: FrameType | None) -> None:
        """``kill -HUP``: every worker looks at the repository and loads what is new."""
        signals.info("SIGHUP: the workers load what is new in the repository")
        for process in self.processes.values():
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, signal.SIGHUP)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.stopping.is_set():
            log.info("stopping the workers (each finishes its batch)")
            self.stopping.set()
        self._tell_to_stop()

    def _tell_to_stop(self) -> None:
        """SIGTERM to every worker not told yet (one may have started after the signal)."""
        for process in self.processes.values():
            pid = process.pid
            if pid is not None and pid not in self._signalled and process.is_alive():
                self._signalled.add(pid)
                os.kill(pid, signal.SIGTERM)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGHUP, self._on_hangup)
        for spec in self.specs:
            if not self.stopping.is_set():
                self._start(spec)
        deadline: float | None = None
        while True:
            if self.stopping.is_set():
                self._tell_to_stop()
                if deadline is None:
                    deadline = time.monotonic() + STOP_TIMEOUT_S
            self.last_turn = time.monotonic()
            self.snapshot = self._running()
            alive = {p.sentinel: i for i, p in self.processes.items() if p.exitcode is None}
            if self.stopping.is_set() and not alive:
                return 0
            if deadline is not None and time.monotonic() > deadline:
                for index in alive.values():
                    log.warning("worker %d did not stop in time; killing it", index)
                    self.processes[index].kill()
                deadline = time.monotonic() + 5
            wait(list(alive), timeout=0.2)
            # Every exit, those reaped by the exitcode check above included (before: a worker
            # that died between two turns was reaped there, and never restarted).
            for index, process in list(self.processes.items()):
                if process.exitcode is not None and process.pid not in self._exits:
                    self._exited(index)
            self._restart_due()

    def _exited(self, index: int) -> None:
        process = self.processes[index]
        process.join(timeout=1)
        self._exits.add(process.pid)
        if self.stopping.is_set():
            return
        if time.monotonic() - self._started.get(index, 0.0) >= STABLE_S:
            self._backoff.reset(index)  # it served a while: start the backoff afresh
        crashed = process.exitcode is not None and process.exitcode < 0  # a signal
        if crashed and not self._loaded[index].is_set():
            self._leave_runtimes_out(index)
        delay = self._backoff.next_delay(index)
        log.error(
            "worker %s died (exit code %s); restarting it in %.1f s",
            self.specs[index].name,
            process.exitcode,
            delay,
        )
        self._due[index] = time.monotonic() + delay

    def _leave_runtimes_out(self, index: int) -> None:
        """Under ``MB_RUNTIME=auto``, a worker that crashed while it loaded and self-tested
        the runtimes (native code aborting on this host, which no self-test catches
        in-process): every worker of this host starts with TorchScript alone from now on."""
        if self.specs[index].config.runtime != "auto":
            return
        log.error(
            "worker %s crashed while loading its runtimes; a runtime other than TorchScript "
            "may crash on this host: its workers serve with TorchScript only",
            self.specs[index].name,
        )
        self.specs = [
            replace(spec, config=replace(spec.config, runtime="torchscript")) for spec in self.specs
        ]

    def _running(self) -> tuple[Running, ...]:
        """Each worker as the probes see it; made by this loop (which alone waits on the
        processes), read by the probes' thread as a whole."""
        now = time.monotonic()
        found = []
        for spec in self.specs:
            process = self.processes.get(spec.index)
            beat = self._beats.get(spec.index)
            found.append(
                Running(
                    spec.name,
                    pid=process.pid if process is not None else None,
                    alive=process is not None and process.exitcode is None,
                    loaded=spec.index in self._loaded and self._loaded[spec.index].is_set(),
                    silent_s=now - beat.value if beat is not None and beat.value else None,
                )
            )
        return tuple(found)

    def serve_probes(self, broker: BrokerPlan) -> None:
        """``MB_HEALTH_PORT``: answer /healthz and /readyz (``app.broker.worker.probes``)."""
        if broker.health_port is None:
            return
        probes = Probes(
            probes_client(broker.url),
            Keys(broker.prefix),
            lambda: self.snapshot,
            lambda: self.last_turn,
            self.stopping.is_set,
        )
        serve_probes(probes, broker.health_port)

    def _restart_due(self) -> None:
        now = time.monotonic()
        for index, when in list(self._due.items()):
            if self.stopping.is_set():
                self._due.clear()
                return
            if now >= when:
                del self._due[index]
                spec = self.specs[index]
                restarts = spec.restarts + 1
                self.specs[index] = replace(spec, restarts=restarts)
                self._start(self.specs[index])
