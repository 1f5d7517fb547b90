"""``python -m app.broker.worker``: model workers for broker mode, on this host.

    MB_BROKER=redis://10.0.0.5:6379/0 CUDA_DEVICES=0,1 MB_WORKER_NUM=4 python -m app.broker.worker

Starts one worker process per device slot, as the server's own pool would (``MB_WORKER_NUM``
spread over ``CUDA_DEVICES``, ``MB_WORKER_THREADS``, ``MB_BATCH_SIZE`` including ``auto``,
``MB_DTYPE``, ``MB_DECODE=device``: ``app.plan`` decides it all). Each verifies and loads
every model of the repository (``MODEL_REPOSITORY``, or ``MODEL_STORE``: its chosen version
of each) and serves their streams at ``MB_BROKER`` (``app.broker.worker.consumer``). Worker
``i`` of this host is named ``<MB_WORKER_NAME or host name>:<i>`` in every life, so a
restarted worker picks up the entries its last life left pending. A worker that dies is
restarted with backoff (``app.broker.worker.supervisor``). ``kill -HUP`` (or
``MB_REPOSITORY_POLL_S``, or the admin route on any front end) makes each load what is new
in the repository beside what it serves, in a thread while it goes on serving, one worker
of the host at a time (``app.broker.worker.versions``). On SIGTERM or Ctrl-C each finishes
the batch it runs, drains what only it holds, and the command exits 0. This supervising
process imports no torch and loads no model: only its children do.
"""

from __future__ import annotations

import argparse
import logging
import sys

from app import tracing
from app.broker.worker.process import ConsumerSpec
from app.broker.worker.supervisor import Supervisor
from app.errors import ModelNotFound, ModelStoreError, SettingsError, StartupError
from app.logs import configure_logging
from app.plan import Role, ServingPlan, plan_serving
from app.repository import Repository
from app.settings import get_settings

log = logging.getLogger("app.worker")


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
