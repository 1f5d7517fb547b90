"""``python -m bench.worker_memory``: a model worker's own loop, without a server, to see how its
memory behaves over many batches of varied sizes.

    python -m bench.worker_memory                       # as a worker runs here (jemalloc if any)
    python -m bench.worker_memory --malloc glibc        # glibc's malloc, tuned and bounded
    python -m bench.worker_memory --malloc glibc --no-bound    # ... and not bounded
    python -m bench.worker_memory --runtime openvino --sizes 32

Prepares a worker as ``app.workers.process.prepare`` does (allocator, threads, runtime,
warm-up at the largest batch), then runs ``--warmup`` and ``--batches`` batches: sizes drawn
from ``--sizes`` (``1-32`` or ``8,32``), three tagging batches to one embedding batch, each on
a thread count drawn from ``--threads`` (``1,2``: a worker's own thread, or two when it
borrows an idle one's), decoding distinct images of varied sizes and formats first (as
``bench.soak`` sends them). Prints the worker's RSS and anonymous memory after the warm-up
and at ten points of the run, the growth, and the seconds the run took (compare runs of one
machine only).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import torch

from app.jobs import Task
from app.lifecycle import ModelSpec
from app.manifest import read_manifest
from app.plan import WorkerConfig
from app.workers import allocator, process
from bench.memory import MB, growth_pct
from bench.soak import model_store, soak_images


def _sizes(text: str) -> list[int]:
    if "-" in text:
        low, high = map(int, text.split("-"))
        return list(range(low, high + 1))
    return [int(part) for part in text.split(",")]


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def _line(label: str) -> str:
    anonymous = allocator.anonymous_bytes()
    return f"  {label:<28} RSS {_rss() / MB:7.1f} MB, anonymous {anonymous / MB:7.1f} MB"


def _on_malloc(wanted: str) -> None:
    """Re-run this command on the malloc asked for (an allocator is chosen at a start)."""
    if wanted == allocator.malloc_in_use():
        return
    environment = dict(os.environ)
    if wanted == "jemalloc":
        extra = allocator.children_environment()
        if not extra:
            sys.exit("jemalloc is not installed here (Debian: libjemalloc2)")
        environment.update(extra)
    else:
        environment.pop("LD_PRELOAD", None)
    command = [sys.executable, "-m", "bench.worker_memory", *sys.argv[1:]]
    os.execve(sys.executable, command, environment)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.worker_memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--sizes", default="1-32", help="batch sizes to draw from")
    parser.add_argument("--threads", default="1,2", help="torch threads to draw from")
    parser.add_argument("--runtime", default="torchscript", help="MB_RUNTIME")
    parser.add_argument(
        "--malloc",
        choices=("jemalloc", "glibc"),
        default="jemalloc" if allocator.jemalloc_library() else "glibc",
    )
    parser.add_argument(
        "--no-bound", dest="bound", action="store_false", help="glibc: never hand memory back"
    )
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--store", type=Path, help="model store (default: model_store/)")
    args = parser.parse_args(argv)
    _on_malloc(args.malloc)
    sizes, threads = _sizes(args.sizes), _sizes(args.threads)
    store = model_store(args.store, Path(tempfile.mkdtemp(prefix="microbatch-worker-memory-")))
    config = WorkerConfig(max_batch_size=max(sizes), decode_threads=1, runtime=args.runtime)
    manifest = read_manifest(store)
    spec = ModelSpec(
        manifest.arch, 1, str(store), manifest.served_id("auto"), manifest.input.image_shape
    )
    worker = process.PreparedWorker(config, "cpu", threads[0])
    prepared = worker.load(spec)
    runner, decoder = prepared.runner, prepared.decoder
    assert decoder is not None
    print(
        f"worker loop: {prepared.runner.models.runtime} on {allocator.malloc_in_use()}'s malloc "
        f"(bound {args.bound}), sizes {args.sizes}, threads {args.threads}",
        flush=True,
    )
    images = soak_images(args.images, args.seed)
    rng = np.random.default_rng(args.seed)
    total = args.warmup + args.batches
    checkpoints = {args.warmup + args.batches * i // 10 for i in range(1, 11)}
    started, baseline = time.perf_counter(), 0
    next_image = 0
    for index in range(1, total + 1):
        size = int(rng.choice(sizes))
        torch.set_num_threads(int(rng.choice(threads)))
        blobs = [images[(next_image + i) % len(images)] for i in range(size)]
        next_image += size
        pixels, _ = decoder.decode(blobs)
        runner.run(Task.EMBEDDING if index % 4 == 0 else Task.TAG, pixels, 5)
        if args.bound:
            worker.memory.after_batch()
        if index == args.warmup:
            baseline, started = _rss(), time.perf_counter()
            print(_line(f"after the warm-up ({index})"), flush=True)
        elif index in checkpoints:
            print(_line(f"{index - args.warmup} batches later"), flush=True)
    print(
        f"  growth after the warm-up: RSS {growth_pct(baseline, _rss()):+.1f}%; "
        f"{args.batches} batches in {time.perf_counter() - started:.0f} s; "
        f"memory handed back {worker.memory.trims} times",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
