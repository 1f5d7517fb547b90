"""``python -m bench.cache``: the response cache (issue #51) on a trace with repeats.

Each run sends a trace of ``/predict/tag`` requests from ``clients`` closed-loop clients:
each request repeats an image already sent in that run with probability ``share`` (one of
those, uniformly), else sends an image never sent before (the bench photos, each made a
distinct file by a JPEG comment: the same pixels, other bytes, so the model runs again).
Every run has its own images, so no run hits another's entries. Shares 0%, 50%, 80% and
95%, at 8 and 64 clients, each with the cache off and on (two servers side by side, taking
turns: each verdict on the median of the turns' ratios) (``MB_CACHE_BYTES``; in broker mode
also ``MB_CACHE_REDIS``, a Redis of its own with ``maxmemory`` and ``allkeys-lru``, as
docs/cache.md advises), in-process and in broker mode (two front ends, one worker).

The issue's targets: at 80% repeats, at least 4x the throughput of the cache off; at 0%,
within 3% of it; a lone hit answered in under 2 ms at p50. Also printed: what hashing a
100 KB upload costs here.

    python -m bench.cache                 # in-process and broker mode
    python -m bench.cache --mode inprocess --quick
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import random
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import redis
import uvloop

from app.manifest import split_served_id
from bench.loadgen import Connection, closed_loop, multipart_request
from bench.systems import RunningServer, bench_jpegs, export_bench_model, free_port, serve

HOST = "127.0.0.1"
MODEL = "efficientnet_lite0"
SHARES = (0.0, 0.5, 0.8, 0.95)
CLIENTS = (8, 64)
CACHE_BYTES = "256MiB"
SPEEDUP_TARGET, MISS_COST_TARGET, LONE_HIT_MS = 4.0, 0.97, 2.0
ROUNDS = 5  # runs of each, off and on in turn, where a target rests on the figure


def distinct(jpeg: bytes, label: str) -> bytes:
    """``jpeg`` with a comment segment after its start marker: the same image, other bytes."""
    comment = label.encode()
    return jpeg[:2] + b"\xff\xfe" + struct.pack(">H", len(comment) + 2) + comment + jpeg[2:]


def trace(
    photos: list[bytes], share: float, length: int, run: str, seed: int = 51
) -> tuple[list[bytes], int]:
    """``length`` requests of which exactly ``round(share * length)`` repeat an image already
    in the trace (one of those, uniformly), in a random order, the first one new; and how
    many distinct images it holds."""
    rng = random.Random(seed)
    repeats = min(round(share * length), length - 1)
    later = [True] * repeats + [False] * (length - 1 - repeats)
    is_repeat = [False, *rng.sample(later, len(later))]
    sent: list[bytes] = []
    requests: list[bytes] = []
    for repeat in is_repeat:
        if repeat:
            image = rng.choice(sent)
        else:
            image = distinct(photos[len(sent) % len(photos)], f"{run}-{len(sent)}")
            sent.append(image)
        requests.append(request_of(image))
    return requests, len(sent)


def throughput(port: int, requests: list[bytes], clients: int) -> tuple[float, int]:
    """Requests answered 200 per second over the whole trace, and the others' count."""
    result = uvloop.run(closed_loop(HOST, port, requests, clients=clients,
                                    total=len(requests)))  # fmt: skip
    return result.statuses[200] / result.seconds, sum(
        count for status, count in result.statuses.items() if status != 200
    )


async def _lone(port: int, request: bytes, count: int) -> list[float]:
    connection = Connection(HOST, port)
    took = []
    try:
        await connection.send(request)  # the miss that fills it
        for _ in range(count):
            started = time.perf_counter()
            response = await connection.send(request)
            took.append(time.perf_counter() - started)
            assert response.status == 200 and response.headers.get("x-cache") == "hit"
    finally:
        await connection.close()
    return took


def lone_hit_ms(port: int, photo: bytes, count: int = 300) -> float:
    request = request_of(distinct(photo, "lone"))
    return 1000 * statistics.median(uvloop.run(_lone(port, request, count)))


def hash_cost_ms(size: int = 100_000, rounds: int = 2000) -> float:
    data = random.Random(0).randbytes(size)
    started = time.perf_counter()
    for _ in range(rounds):
        hashlib.sha256(data).digest()
    return 1000 * (time.perf_counter() - started) / rounds


@contextlib.contextmanager
def cache_redis() -> Iterator[str]:
    """A Redis for the shared cache alone, bounded by ``maxmemory`` with ``allkeys-lru``."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
         "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        client = redis.Redis(host=HOST, port=port, socket_timeout=5)
        deadline = time.monotonic() + 30  # a busy host starts it slowly: wait for its answer
        while True:
            with contextlib.suppress(redis.ConnectionError):
                client.ping()
                break
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("the cache's redis-server did not start")
            time.sleep(0.05)
        client.close()
        yield f"redis://{HOST}:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)


def server(
    mode: str, store: Path, settings: dict[str, str]
) -> contextlib.AbstractContextManager[RunningServer]:
    kind = "cluster" if mode == "broker" else "ours"
    return serve(kind, store, batch_size="32", max_latency=0.005, threads=2, settings=settings,
                 front_ends=2, workers=1)  # fmt: skip


def measure(store: Path, mode: str, quick: bool = False) -> list[dict[str, object]]:
    """Both servers (cache off and on) run side by side, idle but for the run at hand, and
    take turns: each figure is the median of ``ROUNDS`` runs of each where a target rests on
    it (0% and 80%), in alternating order, so a slow spell of the machine falls on both."""
    photos = bench_jpegs(8)
    shares = (0.0, 0.8) if quick else SHARES
    clients_list = (64,) if quick else CLIENTS
    figures: dict[tuple[str, float, int], float] = {}
    paired: dict[tuple[float, int], float] = {}  # the median of each turn's on / off
    with contextlib.ExitStack() as stack:
        on = {"MB_CACHE_BYTES": CACHE_BYTES}
        if mode == "broker":
            on["MB_CACHE_REDIS"] = stack.enter_context(cache_redis())
        # The same runtime and precision for both: what the first chose (each start times
        # them, and a noisy start could choose another).
        ports = {"off": stack.enter_context(server(mode, store, {})).port}
        chosen = serving(ports["off"])
        on |= {"MB_RUNTIME": chosen["runtime"], "MB_DTYPE": chosen["dtype"]}
        ports["on"] = stack.enter_context(server(mode, store, on)).port
        for cache, port in ports.items():
            print(f"{mode}, cache {cache}: serving {serving(port)}", flush=True)
        warm, _ = trace(photos, 0.0, 128, "warm")
        for port in ports.values():
            throughput(port, warm, 64)  # each process's first requests are slower
        capacity, _ = throughput(ports["off"], warm, 64)
        # A run: about 6 s of misses at the server's capacity.
        length = max(200, int(6 * capacity))
        print(f"{mode}: capacity {capacity:.1f} requests/s; {length} requests a run", flush=True)
        for clients in clients_list:
            for share in shares:
                rates: dict[str, list[float]] = {"off": [], "on": []}
                rounds = ROUNDS if share in (0.0, 0.8) else 1
                for turn in range(rounds):
                    for cache in ("off", "on") if turn % 2 == 0 else ("on", "off"):
                        run = f"{mode}-{cache}-{clients}-{share}-{turn}"
                        requests, images = trace(photos, share, length, run)
                        rate, refused = throughput(ports[cache], requests, clients)
                        rates[cache].append(rate)
                        if refused:
                            print(f"  ({run}: {refused} answers not 200)", flush=True)
                paired[(share, clients)] = statistics.median(
                    on / off for on, off in zip(rates["on"], rates["off"], strict=True)
                )
                for cache, got in rates.items():
                    figures[(cache, share, clients)] = statistics.median(got)
                    shown = ", ".join(f"{rate:.1f}" for rate in got)
                    row(f"cache {cache:<3} {clients:>2} clients {share:4.0%} repeats "
                        f"({images} images)", figures[(cache, share, clients)], shown)  # fmt: skip
        lone = lone_hit_ms(ports["on"], photos[0])
        print(f"  a lone hit: p50 {lone:.2f} ms", flush=True)
        kept = request_of(distinct(photos[0], "lone"))
        hits, _ = throughput(ports["on"], [kept] * length, 64)
        row("cache on  64 clients, every request a hit", hits, "")
    # What 80% repeats can give at most here: a miss costs what it did with the cache off, a
    # hit what a stream of hits costs (both on the same two cores as the load generator).
    miss_s, hit_s = 1 / figures[("off", 0.8, 64)], 1 / hits
    print(f"  {mode}: a hit costs {hit_s / miss_s:.1%} of a miss: 80% repeats can give at most "
          f"{1 / (0.2 + 0.8 * hit_s / miss_s):.2f}x", flush=True)  # fmt: skip
    verdicts = []
    # Each verdict on the median of the turns' ratios (a turn runs off and on back to back,
    # so a slow spell of the machine falls on both); the ratio of the medians is printed too.
    for clients in clients_list:
        for share, name, target in ((0.8, "80%", SPEEDUP_TARGET), (0.0, "0%", MISS_COST_TARGET)):
            ratio = paired[(share, clients)]
            of_medians = figures[("on", share, clients)] / figures[("off", share, clients)]
            print(f"  {mode} {clients} clients {name}: on/off {of_medians:.2f} (of the medians)")
            verdicts.append(verdict(f"{mode} {clients} clients {name} on/off, paired", ratio,
                                    f">= {target:g}", ratio >= target))  # fmt: skip
    verdicts.append(
        verdict(f"{mode} lone hit p50 ms", lone, f"< {LONE_HIT_MS:g}", lone < LONE_HIT_MS)
    )
    return verdicts


def serving(port: int) -> dict[str, str]:
    """What a server runs its model with (``/info``): the served id, runtime and dtype."""
    deadline = time.monotonic() + 60
    while True:  # a front end that started last may not have heard a worker's heartbeat yet
        info = httpx.get(f"http://{HOST}:{port}/info", timeout=30).json()
        if info.get("model_id") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    runtimes = {w.get("runtime") for w in info["workers"] if w.get("runtime")} or {"auto"}
    _, dtype = split_served_id(info["model_id"])  # the precision it computes in
    return {"model_id": info["model_id"], "runtime": ",".join(sorted(runtimes)), "dtype": dtype}


def row(label: str, rate: float, runs: str) -> None:
    print(f"  {label:<48} {rate:7.1f} requests/s" + (f"  ({runs})" if runs else ""), flush=True)


def request_of(image: bytes) -> bytes:
    return multipart_request(HOST, 0, "/predict/tag", image)


def verdict(name: str, value: float, target: str, passed: bool) -> dict[str, object]:
    print(f"  {name}: {value:.2f} (target {target}) {'PASS' if passed else 'MISS'}", flush=True)
    return {"name": name, "value": value, "target": target, "pass": passed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("inprocess", "broker", "both"), default="both")
    parser.add_argument("--quick", action="store_true", help="0% and 80%, 64 clients only")
    parser.add_argument("--model", default=MODEL, help=f"to export (default {MODEL})")
    parser.add_argument("--store", type=Path, help="an exported store (default: export one)")
    args = parser.parse_args(argv)
    print(f"sha-256 of 100 KB: {hash_cost_ms():.3f} ms", flush=True)
    modes = ["inprocess", "broker"] if args.mode == "both" else [args.mode]
    with tempfile.TemporaryDirectory() as scratch:
        store = args.store or export_bench_model(args.model, Path(scratch) / "store")
        verdicts = [v for mode in modes for v in measure(store, mode, args.quick)]
    missed = [str(v["name"]) for v in verdicts if not v["pass"]]
    print("cache:", "every target met" if not missed else f"MISS: {', '.join(missed)}")
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
