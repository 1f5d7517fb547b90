"""``python -m app.broker.worker``: model workers for broker mode, on this host.

    MB_BROKER=redis://10.0.0.5:6379/0 CUDA_DEVICES=0,1 MB_WORKER_NUM=4 python -m app.broker.worker

Starts one worker process per device slot, as the server's own pool would (``MB_WORKER_NUM``
spread over ``CUDA_DEVICES``, ``MB_WORKER_THREADS``, ``MB_BATCH_SIZE`` including ``auto``,
``MB_DTYPE``, ``MB_DECODE=device``: ``app.plan`` decides it all). Each verifies and loads
every model of the repository (``MODEL_REPOSITORY``, or ``MODEL_STORE``: its chosen version
of each) and serves their streams at ``MB_BROKER`` (``app.broker.consumer``). Worker ``i`` of
this host is named ``<MB_WORKER_NAME or host name>:<i>`` in every life, so a restarted
worker picks up the entries its last life left pending. A worker that dies is restarted with
backoff (``app.broker.supervisor``). ``kill -HUP`` (or ``MB_REPOSITORY_POLL_S``, or the admin
route on any front end) makes each load what is new in the repository beside what it serves,
in a thread while it goes on serving, one worker of the host at a time
(``app.broker.versions``). On SIGTERM or Ctrl-C each finishes the batch it runs, drains what
only it holds, and the command exits 0. This supervising process imports no torch and loads
no model: only its children do.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.synchronize import Event as EventType
from typing import TYPE_CHECKING, Any

from app import tracing
from app.broker.supervisor import Supervisor
from app.errors import ModelNotFound, ModelStoreError, SettingsError, StartupError
from app.lifecycle import ModelSpec
from app.logs import configure_logging
from app.plan import BrokerPlan, RepositoryPlan, Role, ServingPlan, WorkerConfig, plan_serving
from app.repository import Repository
from app.settings import get_settings
from app.workers.lineage import die_with_parent

if TYPE_CHECKING:
    import redis

    from app.broker.wire.keys import Keys
    from app.workers.process import PreparedWorker

log = logging.getLogger("app.worker")


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
    from app.broker.wire.keys import Keys
    from app.workers.process import LoadFailure, PreparedWorker, start_failure

    reload = threading.Event()  # SIGHUP before the consumer exists: it looks at once
    signal.signal(signal.SIGHUP, lambda *_: reload.set())
    # The supervisor started this process with SIGHUP blocked: one sent before this handler
    # was in place waited, instead of ending the process.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
    configure_logging(spec.config.log_level, spec.config.log_format)
    tracing.configure("worker")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor turns Ctrl-C into SIGTERM
    # The consumer retries on its own (and says so in the log); the client does not.
    client = redis.Redis.from_url(
        spec.broker.url, socket_timeout=10, socket_connect_timeout=5, retry=Retry(NoBackoff(), 0)
    )
    keys = Keys(spec.broker.prefix)
    repository = Repository.of_plan(spec.repository)
    failures: list[tuple[ModelSpec, str, str]] = []
    try:
        # Chosen now, not when the supervisor started: a worker restarted after a rollout
        # comes back with the versions that serve then.
        models = starting_versions(client, keys, repository, spec.config.dtype, spec.name)
        worker = PreparedWorker(spec.config, spec.device, spec.threads)
        for model in models:
            try:
                load_in_fleet_precision(client, keys, worker, model)
            except LoadFailure as exc:
                failures.append((model, exc.step, exc.message))
        worker.load_delay_s = spec.config.load_delay_for(spec.index)  # rollouts' loads only
        held = {m.spec.name for m in worker.models.values()}
        for model, step, message in failures:
            if model.name not in held:  # nothing of this model serves: it cannot start
                raise LoadFailure(model, step, message)
    except Exception as exc:
        log.error("worker %s on %s failed to start: %s", spec.name, spec.device, start_failure(exc))
        sys.exit(2)
    if loaded is not None:
        loaded.set()
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
        keys,
        spec.name,
        worker,
        repository=repository,
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
    consumer.versions.start(failures)
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
    try:
        consumer.run(stop)
    finally:
        tracing.shutdown()  # export the last spans


def load_in_fleet_precision(
    client: redis.Redis, keys: Keys, worker: PreparedWorker, spec: ModelSpec
) -> None:
    """Load ``spec`` in the precision the fleet serves it in, or choose and record it
    (``app.broker.loading.fleet_decided``); without Redis, as this worker chooses."""
    from redis.exceptions import RedisError

    from app.broker.loading import fleet_decided, record_precision
    from app.broker.wire.control import Precisions

    precisions = Precisions(client, keys)
    try:
        decided = fleet_decided(precisions, worker, spec)
    except (RedisError, OSError) as exc:
        log.warning("the fleet's precision of %s is unknown (%s)", spec.served_id, exc)
        decided = spec
    model = worker.load(decided)
    try:
        fleet = record_precision(precisions, worker, decided, model.spec)
    except (RedisError, OSError):
        fleet = None
    if fleet is not None:  # another worker recorded another precision first
        worker.unload(model.spec.served_id)
        del model
        worker.load(fleet)


def starting_versions(
    client: redis.Redis, keys: Keys, repository: Repository, dtype: str, name: str
) -> list[ModelSpec]:
    """What a worker loads as it starts, for each model: the version the other live
    workers serve now, if it has it on disk (so it serves at once, even mid-rollout), then
    the version its name should serve (``app.lifecycle.chosen_version``, with what the admin
    route chose), unless the others gave that one up. Without Redis: the latter alone."""
    from redis.exceptions import RedisError

    from app.broker.wire.control import PinReader
    from app.broker.wire.live import LiveWorkers
    from app.lifecycle import given_up, routes

    try:
        pins = PinReader(client, keys).read()
        others = LiveWorkers(keys).read(client).others(name)
    except (RedisError, OSError) as exc:
        log.warning("worker %s: Redis cannot say what serves now (%s)", name, exc)
        pins, others = {}, []
    served, gave_up = routes(others), given_up(others)
    specs: list[ModelSpec] = []
    for model in repository.names():
        target = repository.chosen(model, pins.get(model))
        if target is None:  # unloaded by the admin route
            continue
        route = served.get(model)
        numbers = [target]
        if route is not None and route.version != target:
            numbers = [route.version] if (model, target) in gave_up else [route.version, target]
        for number in numbers:
            if number not in repository.versions(model):
                continue
            spec = repository.read(model, number, dtype, verify=False).spec
            if number == target or spec.served_id == route.served_id:  # type: ignore[union-attr]
                specs.append(spec)
    return specs


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
        tracing.wanted()  # each worker process turns it on; a setting it cannot honour: now
        plan = plan_serving(settings, Role.WORKERS)
        repository = Repository.of_plan(plan.repository)
        models = [item.spec for item in repository.read_chosen(plan.worker.dtype)]  # fail here
        specs = consumer_specs(plan)
    except (ModelStoreError, StartupError, ModelNotFound, SettingsError) as exc:
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


if __name__ == "__main__":
    sys.exit(main())
