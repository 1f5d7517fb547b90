"""``python -m bench.answers --baseline REF``: what an answer costs the HTTP process, this tree
against commit ``REF`` in turns: ``/predict/embedding`` (an answer of 1,280 numbers) and
``/predict/tag`` (five labels), the default model and settings; and ``/predict/tag`` answered
by the response cache (``MB_CACHE_BYTES``), where the HTTP process's own cost is all there is.

For each: the p50 of lone requests at one client (one at a time, on a kept-alive connection),
and images/s at 8 clients with the HTTP process's CPU per request. Prints every turn, then
the medians' ratios (this tree over ``REF``).

    python -m bench.answers --baseline cb8a6a8 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import uvloop

from bench.baseline import source_tree
from bench.loadgen import Connection, closed_loop, multipart_request
from bench.systems import REPO, RunningServer, bench_jpegs, export_bench_model, serve

HOST = "127.0.0.1"
PATHS = ("/predict/embedding", "/predict/tag")
HIT = "/predict/tag, a cache hit"  # MB_CACHE_BYTES on, one image asked again and again
LONE, CLIENTS, LOAD_S = 300, 8, 6.0


def measure(source: Path, store: Path, jpegs: list[bytes]) -> dict[str, tuple[float, float, float]]:
    """``row -> (lone p50 ms, images/s at CLIENTS, HTTP CPU ms per request)``."""
    out = {}
    defaults = {"MB_RUNTIME": "auto", "MB_DTYPE": "auto"}

    def server_with(settings: dict[str, str]) -> contextlib.AbstractContextManager[RunningServer]:
        return serve("ours", store, batch_size="32", max_latency=0.005, threads=2,
                     settings=defaults | settings, source=source)  # fmt: skip

    with server_with({}) as server:
        for path in PATHS:
            out[path] = _timed(
                server, [multipart_request(HOST, server.port, path, j) for j in jpegs]
            )
    with server_with({"MB_CACHE_BYTES": "64MiB"}) as server:
        # One image again and again: after the first, every answer is the response cache's.
        request = multipart_request(HOST, server.port, "/predict/tag", jpegs[0])
        out[HIT] = _timed(server, [request])
        cache = uvloop.run(_cache_header(server.port, request))
        assert cache == "hit", f"X-Cache: {cache}: this tree keeps no answers (MB_CACHE_BYTES)"
    return out


async def _cache_header(port: int, request: bytes) -> str | None:
    connection = Connection(HOST, port)
    try:
        return (await connection.send(request)).headers.get("x-cache")
    finally:
        await connection.close()


def _timed(server: RunningServer, requests: list[bytes]) -> tuple[float, float, float]:
    uvloop.run(closed_loop(HOST, server.port, requests, clients=1, total=30))  # warm
    lone = uvloop.run(closed_loop(HOST, server.port, requests, clients=1, total=LONE))
    cpu = server.cpu_seconds(http_only=True)
    load = uvloop.run(closed_loop(HOST, server.port, requests, clients=CLIENTS, duration_s=LOAD_S))
    cpu = server.cpu_seconds(http_only=True) - cpu
    assert set(lone.statuses) == set(load.statuses) == {200}, (lone.statuses, load.statuses)
    p50 = 1000 * statistics.median(lone.latencies_s)
    return p50, load.requests / load.seconds, 1000 * cpu / load.requests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.answers", description=__doc__)
    parser.add_argument("--baseline", required=True, help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    jpegs = bench_jpegs()
    with tempfile.TemporaryDirectory(prefix="microbatch-answers-") as tmp:
        store = export_bench_model("efficientnet_lite0", Path(tmp) / "store")
        trees = {"before": source_tree(args.baseline, Path(tmp) / "baseline"), "after": REPO}
        runs: dict[str, list[dict[str, tuple[float, float, float]]]] = {k: [] for k in trees}
        for turn in range(args.rounds):
            for label in ("before", "after") if turn % 2 == 0 else ("after", "before"):
                started = time.monotonic()
                runs[label].append(measure(trees[label], store, jpegs))
                for path, (p50, rate, cpu) in runs[label][-1].items():
                    print(f"turn {turn + 1} {label:6} {path:26} lone p50 {p50:6.2f} ms  "
                          f"{rate:6.1f} img/s  HTTP CPU {cpu:5.3f} ms/request  "
                          f"({time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip
    print(f"\nmedians over {args.rounds} turns, after / before ({args.baseline}):")
    print(f"| answer | lone p50 ms | images/s at {CLIENTS} | HTTP CPU ms/request |")
    print("|---|---|---|---|")
    for path in (*PATHS, HIT):
        cells = []
        for field in range(3):
            before = statistics.median(run[path][field] for run in runs["before"])
            after = statistics.median(run[path][field] for run in runs["after"])
            cells.append(f"{before:.2f} -> {after:.2f} (x{after / before:.3f})")
        print(f"| {path} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
