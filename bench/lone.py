"""``python -m bench.lone``: where a lone request's time goes (issue #48), step by step, from
the traces the server makes (``app.tracing``), against the model and the decoder timed alone
in this process in the same run.

    python -m bench.lone                        # in-process, default settings
    python -m bench.lone --mode broker          # the same through Redis (one front end)
    python -m bench.lone --broker --baseline REF  # and broker mode and commit REF, in turns
    python -m bench.lone --requests 300 --paced 20

One server with its defaults (``MB_RUNTIME`` and ``MB_DTYPE`` at auto), tracing to a
receiver on loopback; only requests that send a sampled ``traceparent`` are traced
(``parentbased_always_off``), so the untraced requests cost nothing of it. In turns, so
that every figure sees the same machine:

- ``closed loop``: one client, each request as soon as the last answered; untraced (the
  figure at the client) and traced (the steps);
- ``after idle``: one request after a pause of ``--pause`` seconds (sparse traffic: the
  worker's and OpenVINO's threads have gone to sleep), untraced and traced alike;
- ``alone``: the served model at batch 1 (the same runtime, precision, threads and static
  shape as the worker's, with its classifier head and top-k) and the workers' decoder on one
  thread, each timed in this process.

Prints the p50 of every step and the issue's targets as ratios: a lone request within
(model + decode alone) + 1.0 ms at the client, and the worker's time per lone image (its
``batch`` span) within 1.15x the same two alone. ``python -m bench`` prints the same table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
import torch

from bench.baseline import source_tree
from bench.breakdown import (
    BEFORE,
    BROKER,
    CLOSED,
    IDLE,
    OURS,
    PLAIN,
    Breakdown,
    Sample,
    complete,
    summarise,
)
from bench.loadgen import Connection, closed_loop, multipart_request
from bench.systems import RunningServer, bench_jpegs, export_bench_model, serve
from tests.otlp import Receiver, receiving

HOST = "127.0.0.1"
MODEL = "efficientnet_lite0"
DEFAULTS = {"MB_RUNTIME": "auto", "MB_DTYPE": "auto"}
SETTLE_S = 0.5  # after timing the model here, before a turn: its runtime's threads sleep again
# With a baseline: this server's images/s at these clients, against the baseline's, alternated
THROUGHPUT_CLIENTS, THROUGHPUT_ROUNDS, THROUGHPUT_S = (8, 64), 4, 3.0


def traceparent(index: int) -> tuple[str, str]:
    """A sampled W3C traceparent of its own for request ``index``, and its trace id."""
    trace_id = f"{os.getpid():08x}{index:024x}"
    return f"00-{trace_id}-{index + 1:016x}-01", trace_id


class Lone:
    """One client against ``server``: requests built once, sent one at a time."""

    def __init__(self, server: RunningServer, jpegs: list[bytes], path: str) -> None:
        self.server, self.jpegs, self.path = server, jpegs, path
        self.sent = 0

    def request(self, traced: bool) -> tuple[bytes, str | None]:
        self.sent += 1
        data = self.jpegs[self.sent % len(self.jpegs)]
        headers: list[tuple[str, str]] = []
        trace_id = None
        if traced:
            header, trace_id = traceparent(self.sent)
            headers.append(("traceparent", header))
        built = multipart_request(
            HOST, self.server.port, self.path, data, fields=[("k", "5")], headers=headers
        )
        return built, trace_id

    async def send(
        self, count: int, traced: bool, pause_s: float
    ) -> list[tuple[float, str | None]]:
        """``count`` requests, each ``pause_s`` after the last answer (on a connection kept
        alive, as a real client keeps it); ``(ms at the client, trace id)`` each."""
        connection = Connection(HOST, self.server.port)
        out = []
        try:
            for _ in range(count):
                if pause_s:
                    await asyncio.sleep(pause_s)
                built, trace_id = self.request(traced)
                started = time.perf_counter()
                response = await connection.send(built)
                took = 1000 * (time.perf_counter() - started)
                if response.status != 200:
                    raise RuntimeError(f"a lone request answered {response.status}")
                out.append((took, trace_id))
        finally:
            await connection.close()
        return out


class Alone:
    """The served model at batch 1 and the workers' decoder, timed in this process."""

    def __init__(self, store: Path, serving: str, threads: int, jpegs: list[bytes]) -> None:
        from app.images import DEFAULT_MAX_PIXELS
        from app.jobs import Task
        from app.manifest import read_manifest
        from app.workers.decoding import Decoder
        from app.workers.models import LoadOptions, load_models
        from app.workers.runner import BatchRunner

        runtime, _, precision = serving.partition("+")
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}.get(
            precision, torch.float32
        )
        options = LoadOptions(dtype=dtype, threads=threads, static_batches=(1,))
        models = load_models(store, torch.device("cpu"), options, runtime=runtime)  # type: ignore[arg-type]
        runner = BatchRunner(models, torch.device("cpu"))
        spec = read_manifest(store).input
        decoder = Decoder(spec, 1, max_pixels=DEFAULT_MAX_PIXELS)
        pixels = np.zeros((1, *runner.image_shape), dtype=np.uint8)
        out = np.empty(runner.image_shape, dtype=np.uint8)
        self._model: Callable[[], object] = lambda: runner.run(Task.TAG, pixels, 5)
        self._decode = [lambda data=data: decoder.one(data, out) for data in jpegs]
        self._decoder, self._threads = decoder, threads
        for _ in range(20):
            self._model()

    def close(self) -> None:
        self._decoder.close()

    def time(self, into: dict[str, list[float]], rounds: int) -> None:
        torch.set_num_threads(1)  # the decoder's own threads run torch on one
        for index in range(rounds):
            for label, call in (("model", self._model), ("decode", self._decode[index % 4])):
                started = time.perf_counter()
                call()
                into[label].append(1000 * (time.perf_counter() - started))
        torch.set_num_threads(self._threads)


@contextmanager
def lone_server(
    store: Path, mode: str, threads: int, receiver: Receiver
) -> Iterator[RunningServer]:
    settings = {
        **DEFAULTS,
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_TRACES_SAMPLER": "parentbased_always_off",
    }
    kind = "ours" if mode == "inprocess" else "cluster"
    with serve(
        kind, store, batch_size="32", max_latency=0.005, threads=threads, settings=settings,
        front_ends=1,
    ) as server:  # fmt: skip
        yield server


def measure(
    store: Path,
    jpegs: list[bytes],
    *,
    mode: str = "inprocess",
    threads: int = 2,
    requests: int = 200,
    paced: int = 16,
    pause_s: float = 1.0,
    turns: int = 6,
    plain: bool = True,
    baseline: Path | None = None,
    broker: bool = False,
) -> Breakdown:
    """The breakdown (see the module's docstring), in ``turns``; with ``plain``, the plain
    FastAPI + OpenVINO app (``bench.peers.openvino_app``) in the same turns; with
    ``baseline`` (a source tree), the same server run from it, untraced, in the same turns;
    with ``broker``, the same server in broker mode (one front end, one worker, its own
    Redis: ``mode`` must be in-process), untraced, in the same turns."""
    with ExitStack() as stack:
        receiver = stack.enter_context(contextmanager(receiving)())
        server = stack.enter_context(lone_server(store, mode, threads, receiver))
        senders = {OURS: Lone(server, jpegs, "/predict/tag")}
        if plain:
            peer = stack.enter_context(
                serve("openvino-plain", store, batch_size="1", max_latency=0.0, threads=threads)
            )
            senders[PLAIN] = Lone(peer, jpegs, "/predict/tag")
        if broker:
            cluster = stack.enter_context(
                serve("cluster", store, batch_size="32", max_latency=0.005, threads=threads,
                      settings=DEFAULTS, front_ends=1)
            )  # fmt: skip
            senders[BROKER] = Lone(cluster, jpegs, "/predict/tag")
        before = None
        if baseline is not None:
            before = stack.enter_context(
                serve("ours" if mode == "inprocess" else "cluster", store, batch_size="32",
                      max_latency=0.005, threads=threads, settings=DEFAULTS, front_ends=1,
                      source=baseline)
            )  # fmt: skip
            senders[BEFORE] = Lone(before, jpegs, "/predict/tag")
        serving = server.serving()
        alone = Alone(store, serving, threads, jpegs)
        stack.callback(alone.close)
        sample = Sample()
        for sender in senders.values():
            asyncio.run(sender.send(20, traced=False, pause_s=0))  # warm
        for turn in range(turns):
            alone.time(sample.alone_ms, rounds=requests // turns)
            time.sleep(SETTLE_S)
            asyncio.run(
                _turn(senders, sample, requests // turns, paced // turns, pause_s, shift=turn)
            )
        throughput = _throughput(server, before, jpegs) if before is not None else {}
        wanted = set(sample.traced)
        spans = receiver.wait_for(
            lambda got: all(complete(got, trace_id) for trace_id in wanted), timeout_s=30
        )
    breakdown = summarise(sample, spans, serving)
    breakdown.throughput = throughput
    return breakdown


def _throughput(
    ours: RunningServer, before: RunningServer, jpegs: list[bytes]
) -> dict[int, tuple[float, float, float]]:
    """Images/s of both at each of ``THROUGHPUT_CLIENTS``, in ``THROUGHPUT_ROUNDS`` rounds that
    alternate which goes first: (ours, before) medians and the median of the rounds' ratios."""
    out = {}
    for clients in THROUGHPUT_CLIENTS:
        rates: dict[str, list[float]] = {OURS: [], BEFORE: []}
        for round_ in range(THROUGHPUT_ROUNDS):
            pair = [(OURS, ours), (BEFORE, before)][:: 1 - 2 * (round_ % 2)]
            for name, server in pair:
                requests = [
                    multipart_request(HOST, server.port, "/predict/tag", data, fields=[("k", "5")])
                    for data in jpegs
                ]
                result = asyncio.run(
                    closed_loop(
                        HOST, server.port, requests, clients=clients, duration_s=THROUGHPUT_S
                    )
                )
                rates[name].append(result.rate)
        ratios = [a / b for a, b in zip(rates[OURS], rates[BEFORE], strict=True)]
        out[clients] = (
            statistics.median(rates[OURS]),
            statistics.median(rates[BEFORE]),
            statistics.median(ratios),
        )
    return out


async def _turn(
    senders: dict[str, Lone],
    sample: Sample,
    closed: int,
    paced: int,
    pause_s: float,
    shift: int,
) -> None:
    """One turn: each sender's closed loop (ours untraced, ours traced, the others), then
    the paced requests, one of each in turn, each after ``pause_s`` of idle. The order
    starts ``shift`` places further each turn: whoever goes first meets what ran before."""
    ways = [(name, traced) for name in senders for traced in (False, True)
            if name == OURS or not traced]  # fmt: skip
    ways = ways[shift % len(ways) :] + ways[: shift % len(ways)]
    for name, traced in ways:
        sample.keep(CLOSED, name, await senders[name].send(closed, traced, 0.0), shift)
    for _ in range(paced):
        for name, traced in ways:
            sample.keep(IDLE, name, await senders[name].send(1, traced, pause_s), shift)


def report(breakdown: Breakdown, label: str, indent: str = "") -> None:
    print(
        f"{indent}{label}: a lone /predict/tag, p50 in ms ({breakdown.requests[CLOSED]} untraced "
        f"and as many traced in a closed loop; {breakdown.requests[IDLE]} of each after idle), "
        f"serving {breakdown.serving}:",
        flush=True,
    )
    for line in breakdown.table() + breakdown.verdicts():
        print(f"{indent}  {line}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.lone",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--mode",
        choices=("inprocess", "broker"),
        default="inprocess",
        help="the server whose steps are traced",
    )
    parser.add_argument(
        "--broker",
        action="store_true",
        help="in-process: also serve in broker mode, in the same turns (its lone p50 against)",
    )
    parser.add_argument(
        "--store", type=Path, help="a model store (default: export the default model)"
    )
    parser.add_argument("--requests", type=int, default=200, help="closed-loop requests, each way")
    parser.add_argument("--paced", type=int, default=16, help="requests after idle, each way")
    parser.add_argument("--pause", type=float, default=1.0, help="seconds of idle before each")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--no-plain", dest="plain", action="store_false", help="skip the plain OpenVINO app"
    )
    parser.add_argument("--baseline", metavar="REF", help="also serve this commit, in turns")
    args = parser.parse_args(argv)
    jpegs = bench_jpegs(4)
    with tempfile.TemporaryDirectory(prefix="microbatch-lone-") as tmp:
        store = args.store or export_bench_model(MODEL, Path(tmp) / MODEL)
        baseline = source_tree(args.baseline, Path(tmp) / "baseline") if args.baseline else None
        breakdown = measure(
            store, jpegs, mode=args.mode, threads=args.threads, requests=args.requests,
            paced=args.paced, pause_s=args.pause, plain=args.plain, baseline=baseline,
            broker=args.broker and args.mode == "inprocess",
        )  # fmt: skip
        report(breakdown, args.mode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
