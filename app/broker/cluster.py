"""``python -m app.broker.cluster``: broker mode on one machine, in one command
(``make run-cluster``).

    python -m app.broker.cluster --front-ends 2 --workers 2          # redis-server on 6379 too
    MB_BROKER=redis://10.0.0.5:6379/0 python -m app.broker.cluster   # a Redis that runs elsewhere

Starts a throwaway ``redis-server`` on 127.0.0.1 (unless ``MB_BROKER`` names one), the model
workers (``python -m app.broker.worker``, ``--workers`` processes) and the front ends (gunicorn with
``app.gunicorn_worker.Worker``, ``--front-ends`` processes on ``HOST``:``PORT``, sharing one
``/metrics`` through a fresh ``PROMETHEUS_MULTIPROC_DIR``). Every other setting comes from
the environment, as usual (``MODEL_REPOSITORY`` for several models). ``kill -HUP`` has the
front ends read the keys file again (``MB_KEYS_FILE``) and every worker of the fleet load
what is new in the repository, as a ``kill -HUP`` of a front end does (the front ends switch
once every worker has it).
Ctrl-C or SIGTERM stops the front ends, then the workers (each finishes its batch), then
Redis; if any of them dies, the rest are stopped too; if it is killed (even with ``-9``),
each of them gets SIGTERM (``app.workers.lineage``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from app.errors import SettingsError
from app.settings import get_settings
from app.workers.lineage import preexec, stop_child


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m app.broker.cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--front-ends", type=int, default=2, help="front-end processes")
    parser.add_argument("--workers", type=int, default=2, help="model worker processes")
    parser.add_argument("--redis-port", type=int, default=6379, help="for the Redis started here")
    return parser.parse_args(argv)


def _wait_for_redis(port: int, process: subprocess.Popen[bytes]) -> None:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"error: redis-server did not start on port {port}") from None
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        settings = get_settings()
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    env = dict(os.environ)  # the children read their settings from it, as always
    started: list[subprocess.Popen[bytes]] = []
    scratch = Path(tempfile.mkdtemp(prefix="microbatch-cluster-"))
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    front_ends: list[subprocess.Popen[bytes]] = []

    def reload(signum: int, frame: FrameType | None) -> None:
        for process in front_ends:  # gunicorn's master tells each front end (app.gunicorn_worker)
            if process.poll() is None:
                process.send_signal(signal.SIGHUP)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, reload)
    try:
        if settings.mb_broker is None:
            binary = shutil.which("redis-server")
            if binary is None:
                print("error: redis-server is not installed (or set MB_BROKER)", file=sys.stderr)
                return 2
            broker = subprocess.Popen(
                [binary, "--port", str(args.redis_port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(scratch)],
                start_new_session=True, preexec_fn=preexec(),
            )  # fmt: skip
            started.append(broker)
            _wait_for_redis(args.redis_port, broker)
            time.sleep(0.2)
            if broker.poll() is not None:  # it could not bind: the ping reached another Redis
                print(f"error: port {args.redis_port} is taken (--redis-port)", file=sys.stderr)
                return 2
            env["MB_BROKER"] = f"redis://127.0.0.1:{args.redis_port}/0"
        env["MB_WORKER_NUM"] = str(args.workers)
        started.append(
            subprocess.Popen(
                [sys.executable, "-m", "app.broker.worker"],
                env=env,
                start_new_session=True,
                preexec_fn=preexec(),
            )
        )
        metrics = scratch / "metrics"
        metrics.mkdir()
        front_env = {**env, "PROMETHEUS_MULTIPROC_DIR": str(metrics)}
        front_ends.append(
            subprocess.Popen(
                [sys.executable, "-m", "gunicorn", "-k", "app.gunicorn_worker.Worker",
                 "-w", str(args.front_ends), "-b", f"{settings.host}:{settings.port}",
                 "--graceful-timeout", str(int(settings.mb_request_timeout) + 5),
                 "app.main:create_app()"],
                env=front_env,
                start_new_session=True,
                preexec_fn=preexec(),
            )
        )  # fmt: skip
        started.append(front_ends[0])
        while not stopping and all(process.poll() is None for process in started):
            time.sleep(0.2)
        return 0 if stopping else 1
    finally:
        for process in reversed(started):  # front ends, workers, Redis: in that order
            stop_child(process, timeout_s=70)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
