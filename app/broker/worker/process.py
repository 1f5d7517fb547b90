"""One broker worker process (``python -m app.broker.worker`` starts one per device slot):
what its supervisor hands it (``ConsumerSpec``, picklable for ``spawn``) and its life
(``consumer_main``): it starts holding nothing and consumes its streams
(``app.broker.worker.consumer``) until told to stop, while its versions
(``app.broker.worker.versions``) load each model the way any load goes: the version the
other workers serve now first, then its target, in the fleet's precision. It dies with its
supervisor."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.synchronize import Event as EventType
from typing import Any

from app import tracing
from app.logs import configure_logging
from app.plan import BrokerPlan, RepositoryPlan, WorkerConfig
from app.repository import Repository
from app.workers.lineage import die_with_parent

log = logging.getLogger("app.worker")

# Twice its longest blocking read (XREADGROUP's 1 s): a primary that hangs is left after it.
SOCKET_TIMEOUT_S = 2.0


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
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from app.broker.wire.connect import connect
    from app.broker.wire.keys import Keys
    from app.broker.worker.consumer import Consumer
    from app.workers.process import PreparedWorker, start_failure

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
    client = connect(
        spec.broker.url,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=2,
        retry=Retry(NoBackoff(), 0),
    )
    keys = Keys(spec.broker.prefix)
    repository = Repository.of_plan(spec.repository)
    try:
        worker = PreparedWorker(spec.config, spec.device, spec.threads)
    except Exception as exc:
        log.error("worker %s on %s failed to start: %s", spec.name, spec.device, start_failure(exc))
        sys.exit(2)
    description = {
        "host": spec.broker.host_name,
        "index": spec.index,
        "pid": os.getpid(),
        "life": os.urandom(8).hex(),
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
        on_started=None if loaded is None else loaded.set,
        load_delay_s=spec.config.load_delay_for(spec.index),  # rollouts' loads only
        restarted=spec.restarts > 0,
    )
    # Start-up is a load like any other: it holds nothing yet, and once it runs its versions
    # load what the other workers serve first, then each target (chosen then, not when the
    # supervisor started: a worker restarted after a rollout comes back with what serves).
    # Restarted by its supervisor (a crash), its targets are what the others were aimed at,
    # not the newest on disk: a crash rolls out nothing; a fresh start of the command does.
    signal.signal(signal.SIGHUP, lambda *_: consumer.request_reload())
    if reload.is_set():
        consumer.request_reload()
    log.info("worker %s on %s up (%d threads); loading its models", spec.name, spec.device,
             spec.threads)  # fmt: skip
    try:
        consumer.run(stop)
    finally:
        tracing.shutdown()  # export the last spans
