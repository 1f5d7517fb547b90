"""``python -m app.broker.worker``: model workers for broker mode, on this host.

    MB_BROKER=redis://10.0.0.5:6379/0 CUDA_DEVICES=0,1 MB_WORKER_NUM=4 python -m app.broker.worker

Starts one worker process per device slot, as the server's own pool would (``MB_WORKER_NUM``
spread over ``CUDA_DEVICES``, ``MB_WORKER_THREADS``, ``MB_BATCH_SIZE`` including ``auto``,
``MB_DTYPE``, ``MB_DECODE=device``: ``app.plan`` decides it all). Each verifies and loads
every model of the repository (``MODEL_REPOSITORY``, or ``MODEL_STORE``: its chosen version
of each) and serves their streams at ``MB_BROKER`` (``app.broker.consumer``). Worker ``i`` of
this host is named ``<MB_WORKER_NAME or host name>:<i>`` in every life, so a restarted
worker picks up the entries its last life left pending. A worker that dies is restarted with
backoff. ``kill -HUP`` (or ``MB_REPOSITORY_POLL_S``) makes each load what is new in the
repository beside what it serves, one worker of the host at a time (``app.broker.rotation``).
On SIGTERM or Ctrl-C each finishes the batch it runs, drains what only it holds, and the
command exits 0. This supervising process imports no torch and loads no model: only its
children do.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as EventType
from types import FrameType
from typing import Any

from app.broker.keys import Keys
from app.broker.probes import Probes, Running
from app.broker.probes import client_for as probes_client
from app.broker.probes import serve as serve_probes
from app.errors import ModelStoreError, SettingsError, StartupError
from app.logs import configure_logging
from app.plan import BrokerPlan, RepositoryPlan, Role, ServingPlan, WorkerConfig, plan_serving
from app.repository import ModelSpec, Repository
from app.settings import get_settings
from app.workers import allocator
from app.workers.backoff import RestartBackoff
from app.workers.lineage import die_with_parent

log = logging.getLogger("app.worker")

STABLE_S = 60.0  # a worker that ran this long before it died restarts without delay growth
STOP_TIMEOUT_S = 60.0  # a worker finishing its batch after SIGTERM gets this long


@dataclass(frozen=True)
class ConsumerSpec:
    """Everything one broker worker process needs, picklable for ``spawn``."""

    index: int
    device: str
    threads: int
    config: WorkerConfig
    broker: BrokerPlan
    batch_timeout_s: float
    max_image_bytes: int
    repository: RepositoryPlan  # what it loads at each start (the chosen versions), and reloads
    load_timeout_s: float = 300.0
    restarts: int = 0
    parent_pid: int = 0  # the supervisor: the worker dies with it (app.workers.lineage)

    @property
    def name(self) -> str:
        """``<host>:<index>``: the same in every life, so a restarted worker picks up the
        entries its last life left pending."""
        return f"{self.broker.host_name}:{self.index}"


def consumer_main(
    spec: ConsumerSpec, loaded: EventType | None = None, beat: Any | None = None
) -> None:
    """Entry point of one broker worker process; sets ``loaded`` once its models are, and
    ``beat`` (a shared double) to ``time.monotonic()`` at each turn of its heartbeat thread.
    It dies with its supervisor (killed, even with ``-9``): an orphan would go on consuming
    under the name its replacement takes."""
    die_with_parent(spec.parent_pid)
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from app.broker.consumer import Consumer
    from app.broker.keys import Keys
    from app.workers.process import prepare, start_failure

    reload = threading.Event()  # SIGHUP before the consumer exists: it looks at once
    signal.signal(signal.SIGHUP, lambda *_: reload.set())
    # The supervisor started this process with SIGHUP blocked: one sent before this handler
    # was in place waited, instead of ending the process.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
    configure_logging(spec.config.log_level, spec.config.log_format)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor turns Ctrl-C into SIGTERM
    try:
        # The versions chosen now, not when the supervisor started: a worker restarted after
        # a rollout comes back with the new version.
        models = chosen_models(spec.repository, spec.config.dtype, verify=False)
        worker = prepare(spec.config, spec.device, spec.threads, tuple(models))
    except Exception as exc:
        log.error("worker %s on %s failed to start: %s", spec.name, spec.device, start_failure(exc))
        sys.exit(2)
    if loaded is not None:
        loaded.set()
    # The consumer retries on its own (and says so in the log); the client does not.
    client = redis.Redis.from_url(
        spec.broker.url, socket_timeout=10, socket_connect_timeout=5, retry=Retry(NoBackoff(), 0)
    )
    description = {
        "host": spec.broker.host_name,
        "index": spec.index,
        "pid": os.getpid(),
        "device": spec.device,
        "threads": spec.threads,
        "restarts": spec.restarts,
    }
    consumer = Consumer(
        client,
        Keys(spec.broker.prefix),
        spec.name,
        worker,
        repository=repository_of(spec.repository),
        host=spec.broker.host_name,
        description=description,
        max_image_bytes=spec.max_image_bytes,
        max_deliveries=spec.broker.max_deliveries,
        batch_timeout_s=spec.batch_timeout_s,
        load_timeout_s=spec.load_timeout_s,
        switch_min_workers=spec.repository.switch_min_workers,
        poll_s=spec.repository.poll_s,
        on_beat=None if beat is None else lambda: setattr(beat, "value", time.monotonic()),
    )
    signal.signal(signal.SIGHUP, lambda *_: consumer.request_reload())
    if reload.is_set():
        consumer.request_reload()
    log.info(
        "worker %s on %s ready (%s; %d threads)",
        spec.name,
        spec.device,
        ", ".join(f"{id} batch<={m.batch_size}" for id, m in worker.models.items()),
        spec.threads,
    )
    consumer.run(stop)


def repository_of(plan: RepositoryPlan) -> Repository:
    """The repository a worker reads: a repository, or a lone store as one."""
    if plan.single:
        return Repository.of_store(plan.root, plan.pins)
    return Repository(plan.root, pins=plan.pins)


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
        log.info("SIGHUP: the workers load what is new in the repository")
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
            for sentinel in wait(list(alive), timeout=0.2):
                self._exited(alive[sentinel])  # type: ignore[index]
            self._restart_due()

    def _exited(self, index: int) -> None:
        process = self.processes[index]
        process.join(timeout=1)
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
        """``MB_HEALTH_PORT``: answer /healthz and /readyz (``app.broker.probes``)."""
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


def consumer_specs(plan: ServingPlan) -> list[ConsumerSpec]:
    """One spec per planned worker of this host (the plan's role is ``Role.WORKERS``: the
    workers decode every upload, which crosses the broker encoded)."""
    assert plan.role is Role.WORKERS and plan.broker is not None
    return [
        ConsumerSpec(
            index=index,
            device=device,
            threads=plan.placement.threads,
            config=plan.worker,
            broker=plan.broker,
            batch_timeout_s=plan.limits.batch_timeout_s,
            max_image_bytes=plan.limits.max_image_bytes,
            repository=plan.repository,
            load_timeout_s=plan.limits.start_timeout_s,
        )
        for index, device in enumerate(plan.placement.devices)
    ]


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="python -m app.broker.worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args(argv)
    try:
        settings = get_settings()
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if settings.mb_broker is None:
        print("error: set MB_BROKER to the Redis URL the front ends use", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    try:
        plan = plan_serving(settings, Role.WORKERS)
        models = chosen_models(plan.repository, plan.worker.dtype, verify=True)  # fail here
        specs = consumer_specs(plan)
    except (ModelStoreError, StartupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log.info(
        "starting %d worker(s) of %s on %s",
        len(specs),
        ", ".join(spec.served_id for spec in models),
        ", ".join(s.device for s in specs),
    )
    assert plan.broker is not None
    supervisor = Supervisor(specs)
    try:
        supervisor.serve_probes(plan.broker)
    except OSError as exc:  # the port is taken
        print(f"error: health port {plan.broker.health_port}: {exc}", file=sys.stderr)
        return 2
    return supervisor.run()


def chosen_models(plan: RepositoryPlan, dtype: str, *, verify: bool) -> list[ModelSpec]:
    """The version of every model a worker loads as it starts (its pin, else its newest);
    ``verify``: every sha256 checked here (a worker's load checks them anyway)."""
    from app.manifest import read_manifest

    repository = repository_of(plan)
    names = repository.names()
    if not names:
        raise ModelStoreError(f"no model in {plan.root}: export one first")
    models = []
    for name in names:
        number = repository.chosen(name)
        store = repository.path(name, number)
        manifest = read_manifest(store, verify=verify)
        served_id = manifest.served_id(dtype)
        models.append(ModelSpec(name, number, str(store), served_id, manifest.input.image_shape))
    return models


if __name__ == "__main__":
    sys.exit(main())
