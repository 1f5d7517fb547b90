"""``python -m bench.coldstart``: what scaling the workers to zero costs the first request.

    python -m bench.coldstart                  # 3 rounds, EfficientNet-Lite0
    python -m bench.coldstart --rounds 5 --json coldstart.json

Broker mode on this machine, as ``bench.chaos`` runs it (a Redis, 2 gunicorn front ends, one
worker supervisor of 1 model worker), with the front ends on ``MB_SCALE_FROM_ZERO=1`` and the
supervisor's probes on ``MB_HEALTH_PORT``. Each round: the supervisor is stopped (workers at
zero; the front ends stay ready); one request is sent and, at the same moment, the supervisor
is started again, as an autoscaler would start a pod the instant it saw the lag. Printed per
round: seconds until the worker's ``/readyz`` (its models loaded, self-tested and warmed up)
and until the queued request was answered. What a cluster adds on top (the autoscaler's
polling interval, scheduling, pulling the image) is not here: docs/kubernetes.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from app.workers.lineage import stop_child
from bench.chaos import HOST, Cluster, free_port

PHOTO = Path(__file__).resolve().parents[1] / "docs" / "cat.jpg"


def wait(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


async def one_round(cluster: Cluster, health: str) -> dict[str, float]:
    stop_child(cluster.processes["supervisor-a"], timeout_s=90)
    wait(lambda: not answers(health), 30, "the probes to go")
    assert cluster.ready(), "the front ends must stay ready with no worker"
    async with httpx.AsyncClient(timeout=120) as client:
        began = time.monotonic()
        request = asyncio.create_task(
            client.post(
                f"http://{HOST}:{cluster.port}/predict/tag",
                files={"image": ("cat.jpg", PHOTO.read_bytes())},
            )
        )
        cluster.start_supervisor("a")
        await asyncio.to_thread(wait, lambda: answers(health), 300, "the worker's /readyz")
        ready_s = time.monotonic() - began
        answer = await request
        answered_s = time.monotonic() - began
    if answer.status_code != 200:
        raise SystemExit(f"the queued request got {answer.status_code}: {answer.text}")
    return {"worker_ready_s": ready_s, "answered_s": answered_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.coldstart", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the rows and medians here")
    args = parser.parse_args(argv)
    from app.export import export

    with tempfile.TemporaryDirectory(prefix="coldstart-") as scratch:
        root = Path(scratch)
        print("exporting EfficientNet-Lite0 (ImageNet weights) ...", flush=True)
        export("efficientnet_lite0", "pretrained", root / "models" / "main" / "1")
        cluster = Cluster(root, root / "models")
        cluster.env.update(MB_SCALE_FROM_ZERO="1", MB_HEALTH_PORT=str(free_port()))
        health = f"http://127.0.0.1:{cluster.env['MB_HEALTH_PORT']}/readyz"
        try:
            cluster.start_redis()
            cluster.start_supervisor("a")
            cluster.start_front_ends()
            wait(cluster.ready, 300, "the front ends")
            wait(lambda: answers(health), 300, "the worker")
            with httpx.Client(timeout=60) as client:  # one answer: the routes are known
                files = {"image": ("cat.jpg", PHOTO.read_bytes())}
                first = client.post(f"http://{HOST}:{cluster.port}/predict/tag", files=files)
                assert first.status_code == 200, first.text
            rows = []
            for index in range(args.rounds):
                row = asyncio.run(one_round(cluster, health))
                rows.append(row)
                print(
                    f"round {index + 1}: worker ready {row['worker_ready_s']:.1f} s, "
                    f"queued request answered {row['answered_s']:.1f} s",
                    flush=True,
                )
        finally:
            cluster.stop()
    medians = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    print("\n| rounds | worker ready (median) | first request answered (median) |")
    print("|---|---|---|")
    print(f"| {len(rows)} | {medians['worker_ready_s']:.1f} s | {medians['answered_s']:.1f} s |")
    if args.json:
        machine = {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "date": time.strftime("%F"),
        }
        args.json.write_text(json.dumps({"rows": rows, "medians": medians, **machine}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
