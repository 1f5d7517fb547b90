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
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from bench.baseline import source_tree
from bench.loadgen import Connection, closed_loop, multipart_request
from bench.systems import RunningServer, bench_jpegs, export_bench_model, serve
from tests.otlp import Received, Receiver, receiving

HOST = "127.0.0.1"
MODEL = "efficientnet_lite0"
DEFAULTS = {"MB_RUNTIME": "auto", "MB_DTYPE": "auto"}
ADDED_MS = 1.0  # a lone request at the client: within model + decode alone + this
WORKER_RATIO = 1.15  # the worker's time per lone image: within this x model + decode alone
SETTLE_S = 0.5  # after timing the model here, before a turn: its runtime's threads sleep again
CLOSED, IDLE = "closed loop", "after idle"
OURS, PLAIN, BEFORE, BROKER = "ours", "openvino-plain", "before", "broker"
BROKER_ADDED_MS = 1.0  # broker mode's lone p50: within the in-process one + this
# After idle, this server's lone p50 against the plain app's: at least this on a CPU with
# bf16 units (where this server computes bf16 and OpenVINO's defaults do too), 1.0 elsewhere.
VS_PLAIN_BF16 = 1.3
# With a baseline: this server's images/s at these clients, against the baseline's, alternated
THROUGHPUT_CLIENTS, THROUGHPUT_ROUNDS, THROUGHPUT_S = (8, 64), 4, 3.0
VS_BEFORE_THROUGHPUT = 0.97
# The steps of one request, in the order they happen: (label, how it is measured).
STEPS = (
    ("client", "at the client, untraced requests"),
    ("request", "the server's request span (traced)"),
    ("read upload", "HTTP body read and multipart parse"),
    ("admission", "admission"),
    ("queue", "the wait for its batch"),
    ("hand-off", "queue end to the worker's batch (pipe, shared memory, wake-up)"),
    ("batch", "the worker's batch span"),
    ("decode", "decode in the worker"),
    ("model", "the model call in the worker"),
    ("way back", "batch end to the answer's encoding"),
    ("encode", "the answer's JSON"),
    ("reply", "the response sent"),
    ("outside", "client (traced) minus the request span: sockets, HTTP parse"),
)


def traceparent(index: int) -> tuple[str, str]:
    """A sampled W3C traceparent of its own for request ``index``, and its trace id."""
    trace_id = f"{os.getpid():08x}{index:024x}"
    return f"00-{trace_id}-{index + 1:016x}-01", trace_id


@dataclass
class Sample:
    """What the turns measured, by way (``CLOSED`` or ``IDLE``)."""

    client_ms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    # Another server's p50s at the client (the plain app, the baseline): sender -> way -> ms
    others_ms: dict[str, dict[str, list[float]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )
    traced: dict[str, dict[str, float]] = field(default_factory=dict)  # trace id -> client ms
    way_of: dict[str, str] = field(default_factory=dict)  # trace id -> way
    alone_ms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    # Untraced answers by (sender, way), one list per turn: for ratios paired by turn.
    by_turn: dict[tuple[str, str], list[list[float]]] = field(
        default_factory=lambda: defaultdict(list)
    )

    def keep(
        self, way: str, sender: str, answers: list[tuple[float, str | None]], turn: int
    ) -> None:
        turns = self.by_turn[(sender, way)]
        while len(turns) <= turn:
            turns.append([])
        turns[turn] += [took for took, trace_id in answers if trace_id is None]
        for took, trace_id in answers:
            if sender != OURS:
                self.others_ms[sender][way].append(took)
            elif trace_id is None:
                self.client_ms[way].append(took)
            else:
                self.traced[trace_id] = {"client": took}
                self.way_of[trace_id] = way


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


def _steps(spans: Sequence[Received]) -> dict[str, float]:
    """One trace's steps in ms (those it has)."""
    named: dict[str, Received] = {}
    for span in spans:
        name = "request" if span.kind == 2 else span.name
        named.setdefault(name, span)
    out = {
        name: (span.end_ns - span.start_ns) / 1e6
        for name, span in named.items()
        if name in {label for label, _ in STEPS}
    }
    batch, queue, encode = named.get("batch"), named.get("queue"), named.get("encode")
    broker = named.get("broker")
    if batch is not None and queue is not None:
        out["hand-off"] = (batch.start_ns - queue.end_ns) / 1e6
    elif batch is not None and broker is not None:
        out["hand-off"] = (batch.start_ns - broker.start_ns) / 1e6
    if batch is not None and encode is not None:
        out["way back"] = (encode.start_ns - batch.end_ns) / 1e6
    return out


@dataclass
class Breakdown:
    """The p50 of every step, by way, and the model and decoder alone."""

    steps: dict[str, dict[str, float]]  # way -> step -> p50 ms
    alone: dict[str, float]  # "model", "decode" -> p50 ms
    serving: str
    requests: dict[str, int]
    others: dict[str, dict[str, float]] = field(default_factory=dict)  # sender -> way -> p50
    # sender -> way -> the median over turns of (its p50 / ours) in that turn
    paired: dict[str, dict[str, float]] = field(default_factory=dict)
    # sender -> way -> the median over turns of (its p50 - ours) in that turn, ms
    added: dict[str, dict[str, float]] = field(default_factory=dict)
    # With a baseline: clients -> (ours, before) images/s and the median of the rounds' ratios
    throughput: dict[int, tuple[float, float, float]] = field(default_factory=dict)

    @property
    def plain(self) -> dict[str, float]:
        return self.others.get(PLAIN, {})

    @property
    def vs_plain_bound(self) -> float:
        return VS_PLAIN_BF16 if "bf16" in self.serving else 1.0

    def verdicts(self) -> list[str]:
        both = self.alone["model"] + self.alone["decode"]
        lines = []
        for way in (CLOSED, IDLE):  # the target is the closed loop's; after idle, for the record
            client = self.steps[way].get("client", float("nan"))
            bound = both + ADDED_MS
            verdict = ("ok" if client <= bound else "MISS") if way == CLOSED else "info"
            lines.append(
                f"lone p50 {way}: {client:.2f} ms against model + decode alone {both:.2f} "
                f"+ {ADDED_MS:.1f} = {bound:.2f} ms (+{client - both:.2f} ms), {verdict}"
            )
        batch = self.steps[CLOSED].get("batch", float("nan"))
        ratio = batch / both
        lines.append(
            f"worker per lone image (batch span, closed loop) {batch:.2f} ms / model + decode "
            f"alone {both:.2f} ms = x{ratio:.2f} (target <= x{WORKER_RATIO}), "
            + ("ok" if ratio <= WORKER_RATIO else "MISS")
        )
        for way in (CLOSED, IDLE) if BEFORE in self.others else ():
            ours, before = self.steps[way]["client"], self.others[BEFORE][way]
            lines.append(
                f"{way}: ours {ours:.2f} ms, before {before:.2f} ms; before / ours, median of "
                f"the turns' ratios: x{self.paired[BEFORE][way]:.2f}"
            )
        for way in (CLOSED, IDLE) if BROKER in self.others else ():
            ours, theirs = self.steps[way]["client"], self.others[BROKER][way]
            added = self.added[BROKER][way]
            verdict = ("ok" if added <= BROKER_ADDED_MS else "MISS") if way == CLOSED else "info"
            lines.append(
                f"broker mode {way}: {theirs:.2f} ms against in-process {ours:.2f} ms; median of "
                f"the turns' differences {added:+.2f} ms (target <= +{BROKER_ADDED_MS:.1f}), "
                + verdict
            )
        for clients, (ours_rate, before_rate, ratio) in self.throughput.items():
            lines.append(
                f"throughput @{clients}: ours {ours_rate:.1f} img/s, before {before_rate:.1f}; "
                f"ours / before, median of the rounds' ratios: x{ratio:.2f} (target >= "
                f"x{VS_BEFORE_THROUGHPUT}), " + ("ok" if ratio >= VS_BEFORE_THROUGHPUT else "MISS")
            )
        for way in (CLOSED, IDLE) if self.plain else ():
            ours, theirs = self.steps[way]["client"], self.plain[way]
            bound, ratio = self.vs_plain_bound, self.paired[PLAIN][way]
            verdict = ("ok" if ratio >= bound else "MISS") if way == IDLE else "info"
            lines.append(
                f"{way}: ours {ours:.2f} ms, {PLAIN} {theirs:.2f} ms; theirs / ours, median of "
                f"the turns' ratios: x{ratio:.2f}"
                + (f" (target >= x{bound})" if way == IDLE else "")
                + f", {verdict}"
            )
        return lines

    def table(self) -> list[str]:
        lines = [
            f"{'step':<12} {CLOSED:>12} {IDLE:>12}   what",
            *(
                f"{label:<12} "
                + " ".join(
                    f"{self.steps[way].get(label, float('nan')):12.2f}" for way in (CLOSED, IDLE)
                )
                + f"   {what}"
                for label, what in STEPS
            ),
            f"{'alone':<12} model {self.alone['model']:.2f} ms ({self.serving}, batch 1, with its "
            f"head and top-k), decode {self.alone['decode']:.2f} ms (one thread)",
        ]
        what = {
            PLAIN: "the plain FastAPI + OpenVINO app at the client, in the same turns",
            BEFORE: "the baseline commit's server at the client, in the same turns",
            BROKER: "this server in broker mode at the client, in the same turns",
        }
        for sender, p50 in self.others.items():
            lines.insert(
                2,
                f"{sender:<12} "
                + " ".join(f"{p50.get(way, float('nan')):12.2f}" for way in (CLOSED, IDLE))
                + f"   {what[sender]}",
            )
        return lines


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
            lambda got: all(_complete(got, trace_id) for trace_id in wanted), timeout_s=30
        )
    breakdown = _summarise(sample, spans, serving)
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


def _complete(spans: list[Received], trace_id: str) -> bool:
    names = {s.name for s in spans if s.trace_id == trace_id}
    return {"batch", "model", "encode"} <= names


def _summarise(sample: Sample, spans: list[Received], serving: str) -> Breakdown:
    by_trace: dict[str, list[Received]] = defaultdict(list)
    for span in spans:
        by_trace[span.trace_id].append(span)
    per_way: dict[str, dict[str, list[float]]] = {
        CLOSED: defaultdict(list),
        IDLE: defaultdict(list),
    }
    for trace_id, measured in sample.traced.items():
        steps = _steps(by_trace[trace_id])
        if "request" in steps:
            steps["outside"] = measured["client"] - steps["request"]
        for step, ms in steps.items():
            per_way[sample.way_of[trace_id]][step].append(ms)
    for way, values in sample.client_ms.items():
        per_way[way]["client"] = values
    p50 = {
        way: {step: statistics.median(values) for step, values in steps.items() if values}
        for way, steps in per_way.items()
    }
    alone = {label: statistics.median(values) for label, values in sample.alone_ms.items()}
    counts = {way: len(sample.client_ms[way]) for way in (CLOSED, IDLE)}
    others = {
        sender: {way: statistics.median(values) for way, values in ways.items() if values}
        for sender, ways in sample.others_ms.items()
    }
    paired = {
        sender: {way: _paired(sample, sender, way) for way in (CLOSED, IDLE)} for sender in others
    }
    added = {
        sender: {
            way: _paired(sample, sender, way, lambda theirs, ours: theirs - ours)
            for way in (CLOSED, IDLE)
        }
        for sender in others
    }
    return Breakdown(p50, alone, serving, counts, others, paired, added)


def _paired(
    sample: Sample,
    sender: str,
    way: str,
    compare: Callable[[float, float], float] = lambda theirs, ours: theirs / ours,
) -> float:
    """The median over turns of ``compare(sender's p50, ours)`` in the same turn (default:
    their ratio)."""
    values = [
        compare(statistics.median(theirs), statistics.median(ours))
        for theirs, ours in zip(
            sample.by_turn[(sender, way)], sample.by_turn[(OURS, way)], strict=True
        )
        if theirs and ours
    ]
    return statistics.median(values) if values else float("nan")


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
