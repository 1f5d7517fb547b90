"""``python -m bench.soak``: does any process of the server grow over a long run?

    python -m bench.soak --mode inprocess                 # python -m app, 2 workers
    python -m bench.soak --mode broker --json soak.json   # Redis + 2 front ends + 2 workers
    python -m bench.soak --requests 20000 --every 5000    # a shorter look

Starts the server on 127.0.0.1 (``--mode inprocess``: ``python -m app`` with
``MB_WORKER_NUM=2``; ``--mode broker``: ``python -m app.broker.cluster``, i.e. its own
``redis-server``, gunicorn front ends and ``python -m app.broker.worker``), sends
``--warmup`` requests, then ``--requests`` more from ``--clients`` closed-loop clients over
hundreds of distinct images (sizes from thumbnails to photos, JPEG, PNG, WebP, BMP and GIF,
generated from a fixed seed; three tagging requests to one embedding request). After the
warm-up and every ``--every`` requests it reads the memory of each process of the server
(RSS; USS and PSS from smaps_rollup) and finally prints, per process and role, RSS after the
warm-up, at each interval and its growth, and writes every sample as JSON (``--json``).

The figures that matter are the growth percentages: timings on a shared machine are noise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from bench.loadgen import closed_loop, multipart_request
from bench.memory import MB, Sample, rows, table

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parents[1]

# (format, share): mostly JPEG, as real uploads are; every accepted decoder gets exercised.
FORMATS = (("JPEG", 0.6), ("PNG", 0.2), ("WEBP", 0.12), ("BMP", 0.04), ("GIF", 0.04))
SMALLEST_SIDE, LARGEST_SIDE = 24, 1600


def soak_images(count: int = 600, seed: int = 0) -> list[bytes]:
    """``count`` distinct encoded images of varied sizes (each side 24-1600 px, log-uniform),
    formats and modes, the same for the same ``seed``. Smooth random colour fields with some
    noise: they compress like photos, neither to nothing nor not at all."""
    rng = np.random.default_rng(seed)
    names = [name for name, _ in FORMATS]
    shares = np.array([share for _, share in FORMATS])
    images = []
    for _ in range(count):
        width, height = np.exp(rng.uniform(np.log(SMALLEST_SIDE), np.log(LARGEST_SIDE), 2))
        size = (int(width), int(height))
        coarse = rng.integers(0, 256, (rng.integers(2, 9), rng.integers(2, 9), 3), np.uint8)
        field = np.asarray(Image.fromarray(coarse).resize(size, Image.Resampling.BILINEAR))
        noisy = field.astype(np.int16) + rng.integers(-12, 13, field.shape, np.int16)
        image = Image.fromarray(noisy.clip(0, 255).astype(np.uint8))
        fmt = str(rng.choice(names, p=shares / shares.sum()))
        if rng.random() < 0.1:
            image = image.convert("L")
        elif fmt in ("PNG", "WEBP") and rng.random() < 0.3:
            image.putalpha(200)
        buffer = io.BytesIO()
        image.save(buffer, format=fmt, **({"quality": 85} if fmt in ("JPEG", "WEBP") else {}))
        images.append(buffer.getvalue())
    return images


def soak_requests(port: int, images: list[bytes]) -> list[bytes]:
    """One request per image: three tagging requests (k=5) to one embedding request."""
    return [
        multipart_request(HOST, port, "/predict/tag", data, fields=[("k", "5")])
        if index % 4
        else multipart_request(HOST, port, "/predict/embedding", data)
        for index, data in enumerate(images)
    ]


def send(
    port: int, requests: list[bytes], offset: int, total: int, clients: int
) -> tuple[float, Counter[int]]:
    """``total`` requests, from ``offset`` on in ``requests`` (cyclically): seconds, statuses."""
    start = offset % len(requests)
    rotated = requests[start:] + requests[:start]
    result = asyncio.run(closed_loop(HOST, port, rotated, clients=clients, total=total))
    return result.seconds, result.statuses


@contextlib.contextmanager
def running(mode: str, store: Path, args: argparse.Namespace) -> Iterator[Any]:
    """The server of ``mode``, started with the benchmark's own launcher."""
    # Imported here: bench.systems imports torch, which the unit tests of this module skip.
    from bench.systems import serve

    kind = {"inprocess": "ours", "broker": "cluster"}[mode]
    settings = {"MB_MAX_LATENCY": str(args.max_latency), "LOG_LEVEL": "warning"}
    with serve(
        kind,
        store,
        batch_size=args.batch_size,
        max_latency=args.max_latency,
        threads=args.threads,
        workers=args.workers,
        front_ends=args.front_ends,
        settings=settings,
    ) as server:
        yield server


def model_store(path: Path | None, scratch: Path) -> Path:
    """``path``, else ``model_store/`` when it holds an export, else a fresh export of the
    default model into ``scratch``."""
    if path is not None:
        return path
    if (REPO / "model_store" / "manifest.json").is_file():
        return REPO / "model_store"
    from bench.systems import export_bench_model

    return export_bench_model("efficientnet_lite0", scratch / "efficientnet_lite0")


def soak(args: argparse.Namespace, store: Path) -> dict[str, Any]:
    """Run one soak; print the progress and the table; return every figure."""
    images = soak_images(args.images, args.seed)
    print(
        f"soak ({args.mode}): {len(images)} distinct images "
        f"({sum(map(len, images)) / len(images) / 1024:.0f} KB average, "
        f"{', '.join(f'{n} {f}' for f, n in Counter(_format(i) for i in images).items())}), "
        f"{args.clients} clients, warm-up {args.warmup}, then {args.requests} requests",
        flush=True,
    )
    chunks: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60 * args.max_minutes
    with running(args.mode, store, args) as server:
        requests = soak_requests(server.port, images)
        seconds, statuses = send(server.port, requests, 0, args.warmup, args.clients)
        print(f"  warm-up: {args.warmup} requests in {seconds:.0f} s {dict(statuses)}", flush=True)
        samples = [Sample.take(server.process.pid, 0)]
        served = 0
        while served < args.requests:
            if time.monotonic() > deadline:
                print(f"  stopped after {args.max_minutes} minutes (--max-minutes)", flush=True)
                break
            count = min(args.every, args.requests - served)
            seconds, statuses = send(
                server.port, requests, args.warmup + served, count, args.clients
            )
            served += count
            samples.append(Sample.take(server.process.pid, served))
            chunks.append({"served": served, "seconds": seconds, "statuses": dict(statuses)})
            workers = [u.rss for u in samples[-1].usages if u.role == "worker"]
            print(
                f"  {served:>7} served: {count / seconds:6.1f} requests/s {dict(statuses)}  "
                f"worker RSS {' '.join(f'{rss / MB:.0f}' for rss in workers)} MB",
                flush=True,
            )
        pids = {u.pid for s in samples for u in s.usages}
    _kill_leftovers(pids)
    print(f"\nRSS in MB ({args.mode}; after the warm-up, then after each {args.every} requests):")
    print(table(samples))
    return {
        "mode": args.mode,
        "settings": {
            key: getattr(args, key)
            for key in (
                "requests",
                "warmup",
                "every",
                "clients",
                "images",
                "seed",
                "workers",
                "front_ends",
                "threads",
                "batch_size",
                "max_latency",
            )
        },
        "store": str(store),
        "chunks": chunks,
        "samples": [asdict(s) for s in samples],
        "growth": [
            {
                "label": r.label,
                "role": r.role,
                "pid": r.pid,
                "rss_warmup": r.rss[0],
                "rss_end": r.rss[-1],
                "rss_growth_pct": r.rss_growth_pct,
                "rss_trend_pct": r.rss_trend_pct,
                "anon_warmup": r.anon_first,
                "anon_end": r.anon_last,
                "anon_growth_pct": r.anon_growth_pct,
            }
            for r in rows(samples)
        ],
    }


def _format(data: bytes) -> str:
    return Image.open(io.BytesIO(data)).format or "?"


def _kill_leftovers(pids: set[int]) -> None:
    """The server stops its own processes; any still there a few seconds later (a launcher
    killed before it could stop its children) is killed here, by the pid it was sampled under.
    (multiprocessing's resource tracker leaves on its own, shortly after its server.)"""
    import psutil

    alive = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            alive.append(psutil.Process(pid))
    for process in psutil.wait_procs(alive, timeout=10)[1]:
        with contextlib.suppress(psutil.NoSuchProcess):
            print(f"  note: {process.name()} ({process.pid}) outlived the server; killing it")
            process.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--mode", choices=("inprocess", "broker"), default="inprocess")
    parser.add_argument("--requests", type=int, default=100_000, help="after the warm-up")
    parser.add_argument("--warmup", type=int, default=2000)
    parser.add_argument("--every", type=int, default=10_000, help="requests between samples")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--images", type=int, default=600, help="distinct images")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2, help="model workers")
    parser.add_argument("--front-ends", type=int, default=2, help="broker mode's front ends")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="torch, in all")
    parser.add_argument("--batch-size", default="32", help="MB_BATCH_SIZE")
    parser.add_argument("--max-latency", type=float, default=0.005, help="MB_MAX_LATENCY, s")
    parser.add_argument("--store", type=Path, help="model store (default: model_store/)")
    parser.add_argument("--max-minutes", type=float, default=120, help="stop sampling after")
    parser.add_argument("--json", type=Path, help="write every sample as JSON")
    args = parser.parse_args(argv)
    for name in ("requests", "warmup", "every", "clients", "images", "workers", "front_ends"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    with tempfile.TemporaryDirectory(prefix="microbatch-soak-") as scratch:
        report = soak(args, model_store(args.store, Path(scratch)))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
