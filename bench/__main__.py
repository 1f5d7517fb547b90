"""``python -m bench``: this server against the raw model, service-streamer and a plain
FastAPI app, on the same model, JPEGs and thread budget, in one run.

    python -m bench                   # full run, under 10 minutes on 2 cores
    python -m bench --quick           # default model, fewer and shorter steps (about 5 min)
    python -m bench --plot perf.png   # also draw throughput and latency vs concurrency
    python -m bench --baseline REF    # also serve commit REF's server, for before/after ratios

Prints, per model: the raw pipeline (decode + preprocess + model, no HTTP) at batch sizes 1,
8 and MB_BATCH_SIZE; each server at each concurrency (closed loop over real HTTP with
multipart JPEG uploads): images/s, p50, p99 and the mean batch the model saw; then the
ratios the project's targets are stated in, against the table in ``bench/targets.py``.
With ``--baseline``, the same configurations served from an earlier commit's source tree
(``make bench`` gives the commit before issue #28) run in the same run, and the before/after
ratios are among the verdicts. The full run (not ``--quick``) ends with ``bench.protocols``
(the v2 protocol over HTTP and gRPC against /predict/tag, one server, in turns) and
``bench.tracing`` (tracing off against on at ratios 0.01 and 1.0, in turns) and
``bench.tenants`` (a noisy neighbour and priorities, open loop, in-process and broker mode)
and ``bench.cache`` (the response cache on traces with repeats, in both modes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from app.manifest import read_manifest
from app.workers.runtimes import cpu_has_bf16
from bench import cache, lone, protocols, tenants, tracing
from bench.baseline import source_tree
from bench.breakdown import IDLE, PLAIN
from bench.loadgen import closed_loop, multipart_request
from bench.plot import write_plot
from bench.report import write_json
from bench.results import MACHINERY_SYSTEMS, ModelReport, Point, ProtocolReport
from bench.systems import (
    REPO,
    RawPipeline,
    RunningServer,
    bench_jpegs,
    decode_cpu_ms,
    export_bench_model,
    runtime_variants,
    serve,
)
from bench.verdicts import ratios

HOST = "127.0.0.1"
# This server as a user starts it: MB_RUNTIME and MB_DTYPE at auto (the bench's own runs pin
# TorchScript fp32 in "ours"), MB_MAX_LATENCY at its default.
DEFAULTS = {"MB_RUNTIME": "auto", "MB_DTYPE": "auto"}
DEFAULT_MAX_LATENCY = 0.005


def upload_requests(server: RunningServer, jpegs: list[bytes]) -> list[bytes]:
    """One tagging request per JPEG (embedding for the do-nothing endpoint), ready to send."""
    path = "/predict/tag" if server.name != "noop" else "/predict/embedding"
    return [multipart_request(HOST, server.port, path, data, fields=[("k", "5")]) for data in jpegs]


def measure(server: RunningServer, jpegs: list[bytes], clients: int, seconds: float) -> Point:
    requests = upload_requests(server, jpegs)
    before = server.batches_and_items()
    cpu = server.cpu_seconds()
    result = asyncio.run(
        closed_loop(HOST, server.port, requests, clients=clients, duration_s=seconds)
    )
    server_cpu_ms = 1000 * (server.cpu_seconds() - cpu) / max(1, result.requests)
    after = server.batches_and_items()
    mean_batch = 1.0
    if before is not None and after is not None and after[0] > before[0]:
        mean_batch = (after[1] - before[1]) / (after[0] - before[0])
    bad = sum(n for status, n in result.statuses.items() if status != 200)
    return Point(
        system=server.name if server.name != "ours" else "ours",
        clients=clients,
        images_per_s=result.rate,
        p50_ms=result.percentile_ms(50),
        p99_ms=result.percentile_ms(99),
        mean_batch=mean_batch,
        errors=bad,
        client_cpu_pct=100 * result.client_cpu_s / result.seconds,
        server_cpu_ms=server_cpu_ms,
    )


def warm_up(server: RunningServer, jpegs: list[bytes]) -> None:
    measure(server, jpegs, clients=2, seconds=1.0)


def idle_latency(
    server: RunningServer, jpegs: list[bytes], raw: RawPipeline, seconds: float, turns: int = 4
) -> tuple[float, float]:
    """p50 (ms) of one client against ``server`` and of the raw loop at batch 1, measured in
    alternating slices so that both see the same machine: on a shared VM the speed drifts by
    20% and more between minutes, which a ratio of two measurements minutes apart would take
    for a difference between them."""
    requests = upload_requests(server, jpegs)
    served: list[float] = []
    alone: list[float] = []
    for _ in range(turns):
        result = asyncio.run(
            closed_loop(HOST, server.port, requests, clients=1, duration_s=seconds / turns)
        )
        served += result.latencies_s
        alone += raw.batch_times(1, seconds / turns)
    return 1000 * statistics.median(served), 1000 * statistics.median(alone)


def p50_in_turns(
    first: RunningServer, second: RunningServer, jpegs: list[bytes], seconds: float, turns: int = 6
) -> tuple[float, float]:
    """p50 (ms) of one client against ``first`` and against ``second``, in alternating
    slices (see ``idle_latency``)."""
    latencies: tuple[list[float], list[float]] = ([], [])
    for turn in range(turns):
        for server, into in ((first, latencies[0]), (second, latencies[1]))[:: 1 - 2 * (turn % 2)]:
            requests = upload_requests(server, jpegs)
            result = asyncio.run(
                closed_loop(HOST, server.port, requests, clients=1, duration_s=seconds / turns)
            )
            into += result.latencies_s
    return 1000 * statistics.median(latencies[0]), 1000 * statistics.median(latencies[1])


def against_baseline(
    report: ModelReport,
    label: str,
    server: RunningServer,
    args: argparse.Namespace,
    jpegs: list[bytes],
    **serve_args: object,
) -> None:
    """The same configuration served from the baseline tree: its images/s at 64 clients (the
    point "before<suffix>"), and both lone p50s, in turns."""
    with serve("ours", source=args.baseline_tree, **serve_args) as before:  # type: ignore[arg-type]
        warm_up(before, jpegs)
        point = measure(before, jpegs, 64, args.seconds)
        point.system = "before" + label[len("ours") :]
        report.points.append(point)
        ours, theirs = p50_in_turns(server, before, jpegs, 2 * args.seconds)
        report.vs_before_p50[label] = (ours, theirs)
        print(
            f"  {point.system:<17} c=64   {point.images_per_s:7.1f} img/s  p50 "
            f"{point.p50_ms:8.1f} ms  CPU {point.server_cpu_ms:.2f} ms/img; lone p50 in turns: "
            f"{label} {ours:.1f} ms, {point.system} {theirs:.1f} ms",
            flush=True,
        )


def run_model(
    model: str, args: argparse.Namespace, jpegs: list[bytes], scratch: Path
) -> ModelReport:
    report = ModelReport(model)
    store = export_bench_model(model, scratch / model)
    raw = RawPipeline(store, jpegs, args.threads)
    for batch_size in sorted({1, 8, args.batch_size}):
        result = raw.run(batch_size, args.raw_seconds)
        report.raw[batch_size] = (result.images_per_s, result.batch_p50_ms)
        print(
            f"  raw pipeline bs={batch_size:<3} {result.images_per_s:7.1f} img/s  "
            f"{result.batch_p50_ms:8.1f} ms/batch",
            flush=True,
        )
    # The runtime axis: each other runtime the export holds, and the precisions below fp32,
    # raw and served.
    variants = runtime_variants(model, store, args.precisions)
    for variant in variants:
        other = RawPipeline(variant.store, jpegs, args.threads, variant.runtime, variant.dtype)
        rows = report.raw_runtimes.setdefault(variant.label, {})
        for batch_size in sorted({1, 8, args.batch_size}):
            result = other.run(batch_size, args.raw_seconds)
            rows[batch_size] = (result.images_per_s, result.batch_p50_ms)
            print(
                f"  raw {variant.label} bs={batch_size:<3} {result.images_per_s:7.1f} img/s  "
                f"{result.batch_p50_ms:8.1f} ms/batch",
                flush=True,
            )
        calibration = read_manifest(variant.store).calibration
        if calibration is not None and variant.dtype == "int8":
            report.accuracy[variant.label] = calibration.held_back.model_dump()
            verdict = "passed" if calibration.passed else "FAILED (kept for the figures)"
            print(
                f"  {variant.label}: {calibration.method}; against fp32 on held-back photos "
                f"{calibration.held_back}; gate {verdict}",
                flush=True,
            )
    # "ours" runs TorchScript in fp32, as the peers and the raw loop do; "ours+<label>" the
    # runtime axis.
    torchscript = {"MB_RUNTIME": "torchscript", "MB_DTYPE": "float32"}
    systems = [("ours", str(args.batch_size), "ours", 1, torchscript, store)]
    systems += [
        (
            "ours",
            str(args.batch_size),
            f"ours+{variant.label}",
            1,
            {"MB_RUNTIME": variant.runtime, "MB_DTYPE": variant.dtype},
            variant.store,
        )
        for variant in variants
    ]
    if args.auto:
        if not args.quick:
            systems.append(("ours", "auto", "ours-auto", 1, torchscript, store))
        if args.threads > 1:  # the same thread budget as one worker per thread
            systems.append(
                ("ours", "auto", f"ours-auto-{args.threads}w", args.threads, torchscript, store)
            )
    # "ours-default": every setting at its default (MB_RUNTIME and MB_DTYPE auto: the runtime
    # and precision chosen on this host, shown beside each of its points), against a plain
    # FastAPI app on OpenVINO with OpenVINO's defaults.
    systems += [
        ("ours", "32", "ours-default", 1, DEFAULTS, store),
        ("openvino-plain", str(args.batch_size), "openvino-plain", 1, {}, store),
        ("service-streamer", str(args.batch_size), "service-streamer", 1, {}, store),
        ("plain", str(args.batch_size), "plain", 1, {}, store),
    ]
    # The same question the server's MB_DTYPE=auto asks before it tries bf16.
    report.bf16_cpu = cpu_has_bf16()
    for kind, batch_size, label, workers, settings, served_store in systems:
        serve_args = {
            "store": served_store,
            "batch_size": batch_size,
            "max_latency": args.max_latency,
            "threads": args.threads,
            "workers": workers,
            "settings": settings,
        }
        if label == "ours-default":
            serve_args["max_latency"] = DEFAULT_MAX_LATENCY
        with serve(kind, **serve_args) as server:
            warm_up(server, jpegs)
            serving = server.serving() if kind == "ours" else ""
            for clients in args.clients:
                point = measure(server, jpegs, clients, args.seconds)
                point.system, point.serving = label, serving
                report.points.append(point)
                print(
                    f"  {label:<17} c={clients:<4} {point.images_per_s:7.1f} img/s  "
                    f"p50 {point.p50_ms:8.1f} ms  p99 {point.p99_ms:8.1f} ms  "
                    f"batch {point.mean_batch:5.1f}  CPU {point.server_cpu_ms:5.2f} ms/img  "
                    f"non-200 {point.errors}  {serving}",
                    flush=True,
                )
            if kind == "ours":
                report.startup[label] = (server.start_s, server.worker_rss_mb())
                print(
                    f"  {label}: ready {server.start_s:.1f} s after launch, largest worker "
                    f"{report.startup[label][1]:.0f} MB resident",
                    flush=True,
                )
            # Idle latency, in turns with the raw loop: for the default configuration (batch
            # 32, one worker with every thread) and the one recommended for CPUs.
            if label == "ours" or workers > 1:
                seconds = args.seconds if args.quick else 2 * args.seconds
                served, alone = idle_latency(server, jpegs, raw, seconds)
                report.idle[label] = (served, alone)
                print(
                    f"  idle latency of {label}, in turns: p50 {served:.1f} ms, "
                    f"raw loop at batch 1 p50 {alone:.1f} ms",
                    flush=True,
                )
            if args.baseline and label in ("ours", "ours+openvino+int8"):
                against_baseline(report, label, server, args, jpegs, **serve_args)
    if model == args.models.split(",")[0]:
        lone_request(report, store, args, jpegs)
    return report


def lone_request(
    report: ModelReport, store: Path, args: argparse.Namespace, jpegs: list[bytes]
) -> None:
    """``bench.lone`` on this server with its defaults: where a lone request's time goes,
    step by step, in a closed loop and after a second of idle, against the model and the
    decoder alone and the plain OpenVINO app (and the baseline commit), in turns."""
    breakdown = lone.measure(
        store,
        jpegs,
        threads=args.threads,
        requests=120 if args.quick else 240,
        paced=8 if args.quick else 18,
        turns=4 if args.quick else 6,
        baseline=args.baseline_tree if args.baseline else None,
    )
    lone.report(breakdown, "lone request", indent="  ")
    plain = breakdown.plain
    if plain:
        ratio = breakdown.paired[PLAIN][IDLE]
        report.vs_plain_p50 = (breakdown.steps[IDLE]["client"], plain[IDLE], ratio)
    report.lone = breakdown.verdicts()


def machinery(args: argparse.Namespace, jpegs: list[bytes], scratch: Path) -> dict[str, float]:
    """Requests/s at 64 clients: a do-nothing FastAPI upload endpoint vs this server with a
    model that does no real work (and the baseline commit's server, with ``--baseline``); the
    load generator's and each server's CPU per request, and the HTTP process's alone."""
    store = export_bench_model("passthrough", scratch / "passthrough")
    out: dict[str, float] = {}
    systems = list(MACHINERY_SYSTEMS)
    if args.quick:  # the bare endpoint and this server's default only
        systems = [system for system in systems if system[0] in ("noop", "ours")]
    if args.baseline:
        # Its defaults (on a CPU host: decoding in the HTTP process), and its worker decode
        # (what its default was on a GPU host, where decode and HTTP are all the CPU does).
        systems += [("before", "ours", 1, {}), ("before-wdec", "ours", 1, {"MB_DECODE": "worker"})]
    for label, kind, workers, settings in systems:
        with serve(
            kind,
            store,
            batch_size=str(args.batch_size),
            max_latency=args.max_latency,
            threads=args.threads,
            workers=min(workers, args.threads),
            settings=settings,
            source=args.baseline_tree if label.startswith("before") else REPO,
        ) as server:
            warm_up(server, jpegs)
            requests = [
                multipart_request(HOST, server.port, "/predict/embedding", d) for d in jpegs
            ]
            cpu, http_cpu = server.cpu_seconds(), server.cpu_seconds(http_only=True)
            result = asyncio.run(
                closed_loop(HOST, server.port, requests, clients=64, duration_s=args.seconds)
            )
            answered = max(1, result.requests)
            out[f"{label}_rps"] = result.rate
            out[f"{label}_client_cpu_pct"] = 100 * result.client_cpu_s / result.seconds
            out[f"{label}_client_cpu_ms"] = 1000 * result.client_cpu_s / answered
            out[f"{label}_server_cpu_ms"] = 1000 * (server.cpu_seconds() - cpu) / answered
            http_ms = 1000 * (server.cpu_seconds(http_only=True) - http_cpu) / answered
            out[f"{label}_http_cpu_ms"] = http_ms
            print(
                f"  {label:<9} {result.rate:8.1f} requests/s  CPU per request: server "
                f"{out[f'{label}_server_cpu_ms']:.2f} ms (its HTTP process {http_ms:.2f}), load "
                f"generator {out[f'{label}_client_cpu_ms']:.2f} ms "
                f"({out[f'{label}_client_cpu_pct']:.0f}% of one core)",
                flush=True,
            )
    # What a box needs where the model costs nothing (a GPU's): a server's CPU per request in
    # ms is the cores it keeps busy per 1,000 requests/s.
    print(
        "  cores per 1,000 requests/s, model aside: "
        + ", ".join(
            f"{label} {mach_ms:.2f}"
            for label, mach_ms in (
                (label, out[f"{label}_server_cpu_ms"])
                for label, kind, *_ in systems
                if kind == "ours"
            )
        ),
        flush=True,
    )
    # The most any server could answer here: all cores busy, each request costing what the
    # bare endpoint and the load generator spend on it plus the decode it cannot skip (the
    # fastest this server has: the workers').
    decode = decode_cpu_ms(store, jpegs)
    out["decode_ms"], out["decode_pillow_ms"] = decode["workers"], decode["pillow"]
    print(
        f"  decode and preprocess, CPU per bench photo on one thread: the workers' "
        f"{out['decode_ms']:.2f} ms, Pillow's {out['decode_pillow_ms']:.2f} ms",
        flush=True,
    )
    cores = len(os.sched_getaffinity(0))
    floor_ms = out["noop_server_cpu_ms"] + out["noop_client_cpu_ms"] + out["decode_ms"]
    out["ceiling_rps"] = 1000 * cores / floor_ms
    print(
        f"  ceiling: {cores} cores / (bare endpoint {out['noop_server_cpu_ms']:.2f} + load "
        f"generator {out['noop_client_cpu_ms']:.2f} + decode {out['decode_ms']:.2f} ms CPU per "
        f"request) = {out['ceiling_rps']:.0f} requests/s",
        flush=True,
    )
    return out


def _exported(model: str, scratch: Path) -> Path:
    """``model``'s store in ``scratch``: this run's export of it, made now if there is none."""
    store = scratch / model
    if not (store / "manifest.json").exists():
        export_bench_model(model, store)
    return store


def three_ways(args: argparse.Namespace, jpegs: list[bytes], scratch: Path) -> ProtocolReport:
    """``bench.protocols`` on the default model, this run's export of it where there is one,
    in its own rounds and turns (not ``--seconds``). Not in ``--quick``: its own server start
    (about 30 s with the runtime self-tests) and 72 turns of 2 s would double that run."""
    print(
        f"{protocols.MODEL}, one server with its defaults, in turns: /predict/tag against the "
        "v2 protocol over HTTP (binary tensors) and gRPC:",
        flush=True,
    )
    return protocols.measure(
        _exported(protocols.MODEL, scratch),
        jpegs,
        clients=list(protocols.CLIENTS),
        seconds=protocols.SECONDS,
        rounds=protocols.ROUNDS,
        threads=args.threads,
    )


def tracing_cost(
    args: argparse.Namespace, jpegs: list[bytes], scratch: Path
) -> dict[int, dict[str, tuple[float, float, float]]]:
    """``bench.tracing`` on the default model: tracing off, and on at ratios 0.01 and 1.0,
    in turns. Not in ``--quick`` (three more servers)."""
    print(f"{tracing.MODEL}, the cost of tracing, in turns:", flush=True)
    return tracing.measure(
        _exported(tracing.MODEL, scratch),
        jpegs,
        clients=list(tracing.CLIENTS),
        seconds=tracing.SECONDS,
        rounds=tracing.ROUNDS,
        threads=args.threads,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="default model, 3 steps, short; skips the 1-worker auto configuration and the "
        "default-decode machinery run",
    )
    parser.add_argument("--models", default="efficientnet_lite0,resnet50")
    parser.add_argument("--clients", default="1,8,32,64,128")
    parser.add_argument("--seconds", type=float, default=4.0, help="per concurrency step")
    parser.add_argument("--raw-seconds", type=float, default=3.0)
    parser.add_argument("--batch-size", type=int, default=32, help="MB_BATCH_SIZE for all")
    parser.add_argument("--max-latency", type=float, default=0.05, help="max latency for all, s")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for every system")
    parser.add_argument(
        "--no-auto",
        dest="auto",
        action="store_false",
        help="skip the MB_BATCH_SIZE=auto run of this server",
    )
    parser.add_argument(
        "--precisions",
        help="precisions below fp32 on the runtime axis: bf16 (CPUs with it), int8 (an export "
        "calibrated on photo views); default 'bf16,int8', none with --quick",
    )
    parser.add_argument(
        "--baseline",
        metavar="REF",
        help="also serve this commit's server (from this clone's history) in the same run: "
        "the machinery step, and the default and int8 configurations at 64 clients and alone",
    )
    parser.add_argument("--plot", type=Path, help="write a PNG of throughput and latency")
    parser.add_argument("--json", type=Path, help="write every figure as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.clients, args.seconds, args.raw_seconds = (
            "efficientnet_lite0",
            "1,8,64",
            2.0,
            1.5,
        )
    args.clients = [int(c) for c in args.clients.split(",")]
    if args.precisions is None:
        args.precisions = "" if args.quick else "bf16,int8"
    args.precisions = [p for p in args.precisions.split(",") if p]
    started = time.monotonic()
    jpegs = bench_jpegs()
    print(
        f"bench: {len(jpegs)} JPEGs ({sum(map(len, jpegs)) // len(jpegs) // 1024} KB average), "
        f"batch size {args.batch_size}, max latency {args.max_latency} s, "
        f"{args.threads} torch threads, {args.seconds:g} s per step",
        flush=True,
    )
    reports: list[ModelReport] = []
    with tempfile.TemporaryDirectory(prefix="microbatch-bench-") as tmp:
        scratch = Path(tmp)
        if args.baseline:
            args.baseline_tree = source_tree(args.baseline, scratch / "baseline")
            print(f"baseline: commit {args.baseline}, served from {args.baseline_tree}")
        print("load generator ceiling and machinery cost (64 clients):", flush=True)
        mach = machinery(args, jpegs, scratch)
        for model in args.models.split(","):
            print(f"{model}:", flush=True)
            reports.append(run_model(model, args, jpegs, scratch))
        protocol_report = None if args.quick else three_ways(args, jpegs, scratch)
        traced = None if args.quick else tracing_cost(args, jpegs, scratch)
        shared: list[dict[str, object]] = []
        kept: list[dict[str, object]] = []
        if not args.quick:  # many callers, open loop (bench.tenants), in-process and broker
            model = _exported(tenants.MODEL, scratch)
            shared = [v for mode in ("inprocess", "broker") for v in tenants.measure(model, mode)]
            # the response cache on a trace with repeats (bench.cache), both modes
            kept = [v for mode in ("inprocess", "broker") for v in cache.measure(model, mode)]
    print(f"\nratios (one run, same machine, {time.monotonic() - started:.0f} s):")
    for line in ratios(reports, mach, protocol_report):
        print("  " + line)
    for line in tracing.verdicts(traced or {}):
        print("  " + line)
    for verdict in shared:
        passed = "PASS" if verdict["pass"] else "MISS"
        print(f"  tenants: {verdict['name']} {verdict['value']:.2f} ({verdict['target']}) {passed}")
    for verdict in kept:
        passed = "PASS" if verdict["pass"] else "MISS"
        print(f"  cache: {verdict['name']} {verdict['value']:.2f} ({verdict['target']}) {passed}")
    if args.plot:
        write_plot(reports, args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        write_json(reports, mach, args.json, protocol_report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
