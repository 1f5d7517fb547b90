"""One broker worker process (``python -m app.broker.worker`` starts one per device slot):
what its supervisor hands it (``ConsumerSpec``, picklable for ``spawn``) and its life
(``consumer_main``): it loads the version of each model that serves now, in the fleet's
precision (``starting_versions``, ``load_in_fleet_precision``), then consumes its streams
(``app.broker.worker.consumer``) until told to stop. It dies with its supervisor."""

from __future__ import annotations

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
from app.lifecycle import ModelSpec
from app.logs import configure_logging
from app.plan import BrokerPlan, RepositoryPlan, WorkerConfig
from app.repository import Repository
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

    from app.broker.wire.keys import Keys
    from app.broker.worker.consumer import Consumer
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
    (``app.broker.worker.loading.fleet_decided``); without Redis, as this worker chooses."""
    from redis.exceptions import RedisError

    from app.broker.wire.control import Precisions
    from app.broker.worker.loading import fleet_decided, record_precision

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
