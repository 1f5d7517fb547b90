"""``python -m bench.rollout``: versions swapped under load, in-process and in broker mode.

    python -m bench.rollout                                   # every scenario (about 35 min)
    python -m bench.rollout --scenarios inprocess-1-slow,broker-slow --json rollout.json

A model repository with one model (``main``) in two versions of different weights
(EfficientNet-Lite0 with its ImageNet weights, and with random ones), and a second model
(``other``) beside it. 16 closed-loop clients send distinct photos to ``main`` while it swaps
between its two versions, per scenario (``SCENARIOS``):

- in-process (``python -m app``), 1 or 2 workers, through the admin load route, with loads as
  they come and with loads made 10 s slower (``MB_TEST_LOAD_DELAY_S``): the worker loads in a
  thread while it serves; what a load costs the requests meanwhile;
- broker mode (``python -m app.broker.cluster``: Redis, 2 gunicorn front ends, 2 workers):
  publishing the other version as the next one and ``kill -HUP``, with loads as they come and
  with loads of 2 s and 15 s on the two workers (longer than any grace period: the rollout
  must wait for the slower one, and switch); and through the admin load route on a front end,
  by version number, back and forth: every swap loads again a version its workers unloaded;
- with a second model under load beside it, in each mode.

Every answer is checked against the reference vector of the version it says computed it
(``X-Model-Id``), computed here with TorchScript in fp32: cosine at least ``MIN_COSINE`` for
the precision the id names (0.999 in fp32; each id's lowest is reported; the two versions'
vectors are nowhere near). Per run: answers by status
(anything but 200 is a failure) and by served id before the first swap and after the last,
answers that do not match their id's reference (must be 0), worker deaths (must be 0),
latency (p50, p99, worst) and throughput while a version loads against steady load, the time
from the call (or the SIGHUP) to the switch, and every process's RSS after each swap, with
its growth after the first swap (flat within 5%).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from app.manifest import split_served_id
from bench.loadgen import Connection, multipart_request
from bench.memory import Sample, rows, table

HOST = "127.0.0.1"
ADMIN_KEY = "bench-admin"
# The least cosine an answer has with its served id's reference (TorchScript in fp32), by the
# precision its id names: fp32 runtimes agree to 0.9999 or better; bf16 and int8 answers are
# further off by design (each served only past its gate, on the mean of its golden images).
# The two versions' vectors are nowhere near, so a version's answers under another's id fail.
MIN_COSINE = {"float32": 0.999, "bfloat16": 0.98, "float16": 0.98, "int8": 0.95}
FLAT_PCT = 5.0


@dataclass(frozen=True)
class Scenario:
    """One way of swapping: where (``inprocess`` or ``broker``), on how many workers, how
    (``admin``: the admin load route, by version number; ``publish``: the other version
    published as the next one, then ``kill -HUP``), with loads slowed by ``delays``
    (``MB_TEST_LOAD_DELAY_S``), with a second model under load, and how many swaps."""

    name: str
    mode: str
    workers: int
    how: str
    delays: str = ""
    second_model: bool = False
    swaps: int = 10
    source: Path | None = None  # another commit's tree to serve (--baseline); None: this one


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("inprocess-1", "inprocess", 1, "admin", swaps=11),
        Scenario("inprocess-1-slow", "inprocess", 1, "admin", delays="10", swaps=3),
        Scenario("inprocess-2", "inprocess", 2, "admin", swaps=11),
        Scenario("inprocess-2-slow", "inprocess", 2, "admin", delays="10", swaps=3),
        Scenario("inprocess-other", "inprocess", 2, "admin", second_model=True, swaps=11),
        Scenario("broker", "broker", 2, "publish", swaps=11),
        Scenario("broker-slow", "broker", 2, "publish", delays="2,15", swaps=3),
        Scenario("broker-reload", "broker", 2, "admin", swaps=11),
        Scenario("broker-other", "broker", 2, "publish", second_model=True, swaps=11),
    )
}


@dataclass
class Answer:
    sent_at: float
    latency_s: float
    status: int
    model: str  # the model asked
    served_id: str
    matched: bool
    cosine: float | None = None  # with its served id's reference (200s of a known id)


@dataclass
class Run:
    """What one scenario measured."""

    scenario: Scenario
    answers: list[Answer] = field(default_factory=list)
    swaps: list[tuple[float, float, float]] = field(default_factory=list)  # asked, switched, done
    samples: list[Sample] = field(default_factory=list)
    deaths: int = 0  # worker restarts over the run
    ids: tuple[str, str] = ("", "")  # main's version before the first swap, and after the last

    def loading(self, at: float) -> bool:
        """Sent while a version loaded (from the call to the switch)."""
        return any(asked <= at <= switched for asked, switched, _ in self.swaps)

    def swapping(self, at: float) -> bool:
        """Sent between a call and the old version's unload."""
        return any(asked <= at <= done for asked, _, done in self.swaps)


# -- the models and their reference vectors ---------------------------------------------------


def build_repository(root: Path, arch: str) -> dict[str, Path]:
    """``main`` versions 1 (pretrained) and 2 (random weights), ``other`` version 1."""
    from app.export import export

    stores = {
        "main-1": root / "main" / "1",
        "main-2": root / "main" / "2",
        "other-1": root / "other" / "1",
    }
    print(f"exporting {arch} three times into {root} ...", flush=True)
    export(arch, "pretrained" if arch == "efficientnet_lite0" else "random", stores["main-1"])
    import torch

    torch.manual_seed(2)
    export(arch, "random", stores["main-2"])
    torch.manual_seed(3)
    export(arch, "random", stores["other-1"])
    return stores


def served_ids(store: Path) -> frozenset[str]:
    """The ids a server may give ``store``'s answers: this tree's, in fp32 or in bf16 (what
    MB_DTYPE=auto chooses on a CPU with bf16 units), and a tree's from before the content
    digest (the first 12 hex of the manifest's sha256)."""
    from app.manifest import read_manifest, served_model_id

    manifest = read_manifest(store)
    ids = {served_model_id(manifest.model_id, dtype) for dtype in ("float32", "bfloat16")}
    return frozenset({*ids, f"{manifest.arch}@{manifest.digest[:12]}"})


def judged(
    body: bytes, served: str, refs: Mapping[str, npt.NDArray[np.float32]], image: int
) -> tuple[float | None, bool]:
    """An embedding answered under ``served`` (``X-Model-Id``): its cosine to image
    ``image``'s reference under that version (None: a version without one), and whether it
    is that image's: at least ``MIN_COSINE`` for the precision that computed it (bf16 rounds
    more than fp32, and stays far from any other image's)."""
    if served not in refs:
        return None, False
    vector = np.frombuffer(body, dtype="<f4")
    cosine = float(vector @ refs[served][image] / (np.linalg.norm(vector) or 1))
    return cosine, cosine >= MIN_COSINE[split_served_id(served)[1]]


def references(stores: dict[str, Path], images: list[bytes]) -> dict[str, npt.NDArray[np.float32]]:
    """served id (either form: ``served_ids``) -> each image's embedding under that
    version, by TorchScript here."""
    import torch

    from app.images import preprocess
    from app.manifest import read_manifest
    from app.workers.models import load_models

    out = {}
    for store in stores.values():
        manifest = read_manifest(store)
        models = load_models(store, torch.device("cpu"))
        pixels = np.stack([preprocess(data, manifest.input) for data in images])
        spec = manifest.input
        batch = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255
        mean = torch.tensor(spec.mean).view(1, 3, 1, 1)
        std = torch.tensor(spec.std).view(1, 3, 1, 1)
        with torch.inference_mode():
            vectors = models.embedding((batch - mean) / std).numpy()
        for served in served_ids(store):
            out[served] = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    return out


# -- load -------------------------------------------------------------------------------------


async def drive(
    port: int,
    images: list[bytes],
    refs: dict[str, npt.NDArray[np.float32]],
    run: Run,
    stop: asyncio.Event,
    clients: int,
) -> None:
    """``clients`` closed-loop clients until ``stop``; with a second model, every fourth
    client asks ``other``. Each answer is checked against its id's reference."""

    def requests(model: str) -> list[bytes]:
        headers = [("Accept", "application/octet-stream")]
        path = f"/predict/embedding?model={model}"
        return [multipart_request(HOST, port, path, data, headers=headers) for data in images]

    prepared = {model: requests(model) for model in ("main", "other")}

    async def client(number: int) -> None:
        model = "other" if run.scenario.second_model and number % 4 == 3 else "main"
        connection = Connection(HOST, port)
        index = number
        try:
            while not stop.is_set():
                image = index % len(images)
                index += clients
                sent = time.monotonic()
                try:
                    async with asyncio.timeout(60):
                        response = await connection.send(prepared[model][image])
                except (OSError, TimeoutError, asyncio.IncompleteReadError):
                    await connection.close()
                    run.answers.append(Answer(sent, time.monotonic() - sent, 0, model, "", False))
                    continue
                served = response.headers.get("x-model-id", "")
                cosine, matched = None, False
                if response.status == 200:
                    cosine, matched = judged(response.body, served, refs, image)
                run.answers.append(
                    Answer(
                        sent,
                        time.monotonic() - sent,
                        response.status,
                        model,
                        served,
                        matched,
                        cosine,
                    )
                )
        finally:
            await connection.close()

    await asyncio.gather(*(client(i) for i in range(clients)))


def serving(port: int, name: str) -> str | None:
    """The served id ``name`` serves now, as the server's index says."""
    rows = httpx.get(f"http://{HOST}:{port}/v2/repository/index", timeout=10).json()
    return next((r["model_id"] for r in rows if r["name"] == name and r["serving"]), None)


def only(port: int, served: frozenset[str], versions: frozenset[str]) -> bool:
    """Whether every worker holds ``served`` (either form of its id) and no other of
    ``versions`` (the swapped model's): the old version is unloaded everywhere."""
    workers = httpx.get(f"http://{HOST}:{port}/info", timeout=10).json()["workers"]
    held = [{m["served_id"] for m in w["models"]} & versions for w in workers]
    return bool(held) and all(len(ids) == 1 and ids <= served for ids in held)


def restarts(port: int) -> int:
    """Worker restarts so far, over every worker slot (a death is a restart)."""
    workers = httpx.get(f"http://{HOST}:{port}/info", timeout=10).json()["workers"]
    return sum(int(w.get("restarts", 0)) for w in workers)


async def until(check: Any, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        await asyncio.sleep(0.1)


async def swap_by_admin(port: int, version: int) -> None:
    """The admin route (in-process, or on a broker front end): answers once it serves."""
    async with httpx.AsyncClient(timeout=600) as http:
        answer = await http.post(
            f"http://{HOST}:{port}/v2/repository/models/main/load",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            json={"parameters": {"version": str(version)}},
        )
    if answer.status_code != 200:
        raise RuntimeError(f"load failed: {answer.status_code} {answer.text}")


async def swap_by_publishing(
    port: int, launcher_pid: int, repository: Path, source: Path, target: frozenset[str]
) -> None:
    """Publish ``source`` as ``main``'s next version, SIGHUP the server (in broker mode, the
    cluster, which tells its workers), and wait until it serves it."""
    from app.repository import publish, staging_folder

    staging = staging_folder(repository / "main")
    shutil.rmtree(staging)
    shutil.copytree(source, staging)
    publish(staging, repository / "main")
    os.kill(launcher_pid, signal.SIGHUP)
    await until(lambda: serving(port, "main") in target)


async def one_run(
    scenario: Scenario,
    stores: dict[str, Path],
    repository: Path,
    images: list[bytes],
    refs: dict[str, npt.NDArray[np.float32]],
    args: argparse.Namespace,
) -> Run:
    from bench.systems import serve

    ids = {key: served_ids(store) for key, store in stores.items()}
    run = Run(scenario)
    by_number = scenario.how == "admin"
    settings = {
        "MODEL_REPOSITORY": str(repository),
        "ADMIN_API_KEY": ADMIN_KEY,
        "LOG_LEVEL": "warning",
        **({"MB_MODEL_VERSIONS": "main=1"} if by_number else {}),
        **({"MB_TEST_LOAD_DELAY_S": scenario.delays} if scenario.delays else {}),
    }
    kind = {"inprocess": "ours", "broker": "cluster"}[scenario.mode]
    source = {"source": scenario.source} if scenario.source is not None else {}
    with serve(
        kind, stores["main-1"], batch_size="32", max_latency=0.005, threads=args.threads,
        workers=scenario.workers, settings=settings, front_ends=2, **source,
    ) as server:  # fmt: skip
        port = server.port
        await until(lambda: serving(port, "main") in ids["main-1"])
        serving_at_start = serving(port, "main") or ""
        deaths = restarts(port)
        stop = asyncio.Event()
        load = asyncio.create_task(drive(port, images, refs, run, stop, args.clients))
        await asyncio.sleep(args.steady_s)
        run.samples.append(Sample.take(server.process.pid, 0))
        for swap in range(1, scenario.swaps + 1):
            key = "main-2" if swap % 2 else "main-1"
            asked = time.monotonic()
            if by_number:
                await swap_by_admin(port, 2 if swap % 2 else 1)
            else:
                pid = server.process.pid
                await swap_by_publishing(port, pid, repository, stores[key], ids[key])
            switched = time.monotonic()
            main_ids = ids["main-1"] | ids["main-2"]
            await until(partial(only, port, ids[key], main_ids))  # the old one unloaded
            run.swaps.append((asked, switched, time.monotonic()))
            run.samples.append(Sample.take(server.process.pid, swap))
            print(
                f"  {scenario.name}: swap {swap} to {key}: switched after "
                f"{switched - asked:.1f} s, old version unloaded "
                f"{time.monotonic() - switched:.1f} s later",
                flush=True,
            )
            await asyncio.sleep(args.steady_s)
        stop.set()
        await load
        run.deaths = restarts(port) - deaths
        first_id, last_id = serving_at_start, serving(port, "main") or ""
        run.ids = (first_id, last_id)
    return run


# -- the report -------------------------------------------------------------------------------


def latency(latencies: list[float]) -> dict[str, float | None]:
    """p50, p99 and the worst, in ms."""
    if not latencies:
        return {"p50": None, "p99": None, "max": None}
    ordered = sorted(latencies)

    def at(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)

    return {"p50": at(0.5), "p99": at(0.99), "max": round(1000 * ordered[-1], 1)}


def rate(answers: list[Answer], windows: list[tuple[float, float]]) -> float | None:
    """Answers per second, over the answers sent within ``windows``."""
    seconds = sum(end - start for start, end in windows)
    inside = sum(1 for a in answers if any(s <= a.sent_at <= e for s, e in windows))
    return round(inside / seconds, 1) if seconds > 0 else None


def lowest_cosines(answers: list[Answer]) -> dict[str, float]:
    """Each served id's lowest cosine with its reference, over its answers."""
    lowest: dict[str, float] = {}
    for a in answers:
        if a.cosine is not None:
            lowest[a.served_id] = round(min(lowest.get(a.served_id, 1.0), a.cosine), 5)
    return lowest


def summary(run: Run) -> dict[str, Any]:
    scenario = run.scenario
    main = [a for a in run.answers if a.model == "main"]
    statuses = Counter(a.status for a in run.answers)
    mismatched = sum(1 for a in run.answers if a.status == 200 and not a.matched)
    loads = [(asked, switched) for asked, switched, _ in run.swaps]
    first_asked = run.swaps[0][0] if run.swaps else math.inf
    last_done = run.swaps[-1][2] if run.swaps else -math.inf
    start = min((a.sent_at for a in run.answers), default=0.0)
    end = max((a.sent_at for a in run.answers), default=0.0)
    steady_windows = [(start, first_asked)]
    steady_windows += [
        (done, asked) for (_, _, done), (asked, _, _) in itertools.pairwise(run.swaps)
    ]
    steady_windows.append((last_done, end))
    steady = [a.latency_s for a in main if not run.swapping(a.sent_at)]
    during = [a.latency_s for a in main if run.loading(a.sent_at)]
    before = Counter(a.served_id for a in main if a.status == 200 and a.sent_at < first_asked)
    after = Counter(a.served_id for a in main if a.status == 200 and a.sent_at > last_done)
    switch_s = [switched - asked for asked, switched in loads]
    growth = [(row.label, row.rss_growth_pct) for row in rows(run.samples[1:])]
    worst = max((pct for _, pct in growth if pct is not None), default=0.0)
    steady_latency, loading_latency = latency(steady), latency(during)
    steady_rate = rate(main, [w for w in steady_windows if w[1] > w[0]])
    loading_rate = rate(main, loads)
    return {
        "scenario": scenario.name,
        "mode": scenario.mode,
        "workers": scenario.workers,
        "how": scenario.how,
        "load_delays_s": scenario.delays or None,
        "second_model": scenario.second_model,
        "swaps": len(run.swaps),
        "answers": len(run.answers),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "non_200": sum(n for status, n in statuses.items() if status != 200),
        "mismatched": mismatched,
        "worker_deaths": run.deaths,
        "by_served_id": dict(Counter(a.served_id for a in run.answers if a.status == 200)),
        "lowest_cosine_by_served_id": lowest_cosines(run.answers),
        "before_first_swap": {
            run.ids[0]: before.get(run.ids[0], 0),
            "other ids": sum(before.values()) - before.get(run.ids[0], 0),
        },
        "after_last_swap": {
            run.ids[1]: after.get(run.ids[1], 0),
            "other ids": sum(after.values()) - after.get(run.ids[1], 0),
        },
        "latency_ms_steady": steady_latency,
        "latency_ms_loading": loading_latency,
        "p99_loading_over_steady": _ratio(loading_latency["p99"], steady_latency["p99"]),
        "images_per_s_steady": steady_rate,
        "images_per_s_loading": loading_rate,
        "throughput_loading_over_steady": _ratio(loading_rate, steady_rate),
        "switch_s_median": round(statistics.median(switch_s), 1) if switch_s else None,
        "switch_s_max": round(max(switch_s), 1) if switch_s else None,
        "rss_growth_after_first_swap_pct": dict(growth),
        "worst_growth_pct": worst,
    }


def _ms(figures: dict[str, float | None]) -> str:
    return "/".join(
        "-" if figures[k] is None else f"{figures[k]:.0f}" for k in ("p50", "p99", "max")
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def report(runs: list[Run]) -> list[dict[str, Any]]:
    summaries = [summary(run) for run in runs]
    print(
        f"\nmodel rollouts ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    )
    head = (
        f"{'scenario':<18}{'swaps':>6}{'answers':>9}{'non-200':>8}{'mixed':>6}{'deaths':>7}"
        f"{'p50/p99/max steady':>20}{'p50/p99/max loading':>21}{'p99 x':>7}{'img/s st/ld':>13}"
        f"{'switch s':>10}{'RSS+':>7}"
    )
    print(head)
    for s in summaries:
        st, ld = s["latency_ms_steady"], s["latency_ms_loading"]
        switch = f"{s['switch_s_median']}/{s['switch_s_max']}" if s["switch_s_max"] else "-"
        print(
            f"{s['scenario']:<18}{s['swaps']:>6}{s['answers']:>9}{s['non_200']:>8}"
            f"{s['mismatched']:>6}{s['worker_deaths']:>7}{_ms(st):>20}{_ms(ld):>21}"
            f"{s['p99_loading_over_steady'] or '-':>7}"
            f"{str(s['images_per_s_steady']) + '/' + str(s['images_per_s_loading']):>13}"
            f"{switch:>10}{s['worst_growth_pct']:>6.1f}%"
        )
    for s, run in zip(summaries, runs, strict=True):
        print(
            f"\n{s['scenario']}: statuses {s['statuses']}; answers before the first swap "
            f"{s['before_first_swap']}, after the last {s['after_last_swap']}"
        )
        print(f"RSS in MB after the warm-up (0), then after each swap:\n{table(run.samples)}")
    verdicts = [
        ("every answer 200", all(s["non_200"] == 0 for s in summaries)),
        ("no answer mismatched its id", all(s["mismatched"] == 0 for s in summaries)),
        ("no worker died", all(s["worker_deaths"] == 0 for s in summaries)),
        (
            f"RSS flat within {FLAT_PCT:g}% after the first swap",
            all(s["worst_growth_pct"] <= FLAT_PCT for s in summaries),
        ),
    ]
    one_slow = [s for s in summaries if s["scenario"] == "inprocess-1-slow"]
    if one_slow:
        s = one_slow[0]
        verdicts.append(
            (
                "one worker, 10 s loads: p99 while loading <= 3x steady, throughput >= 1/2",
                (s["p99_loading_over_steady"] or 99) <= 3
                and (s["throughput_loading_over_steady"] or 0) >= 0.5,
            )
        )
    print()
    for what, ok in verdicts:
        print(f"{'PASS' if ok else 'FAIL'}: {what}")
    return summaries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.rollout",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated")
    parser.add_argument("--swaps", type=int, help="instead of each scenario's own")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--steady-s", type=float, default=5.0, help="load between swaps")
    parser.add_argument("--images", type=int, default=16, help="distinct photos")
    parser.add_argument("--arch", default="efficientnet_lite0")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="torch, in all")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--baseline", metavar="REF", help="also run --baseline-scenarios from commit REF's tree"
    )
    parser.add_argument("--baseline-scenarios", default="inprocess-1,inprocess-2,broker")
    args = parser.parse_args(argv)
    from bench.baseline import source_tree
    from bench.systems import bench_jpegs

    scenarios = [SCENARIOS[name] for name in args.scenarios.split(",")]
    if args.swaps is not None:
        scenarios = [dataclasses.replace(s, swaps=args.swaps) for s in scenarios]
    images = bench_jpegs(args.images)
    runs = []
    with tempfile.TemporaryDirectory(prefix="microbatch-rollout-") as scratch:
        if args.baseline:  # the same swaps served by the earlier commit, first
            tree = source_tree(args.baseline, Path(scratch) / "baseline")
            before = [SCENARIOS[name] for name in args.baseline_scenarios.split(",")]
            if any(s.delays for s in before):
                raise SystemExit("bench: a baseline has no MB_TEST_LOAD_DELAY_S (no slow runs)")
            scenarios = [
                dataclasses.replace(
                    s,
                    name=f"before:{s.name}",
                    source=tree,
                    swaps=min(s.swaps, args.swaps or s.swaps),
                )
                for s in before
            ] + scenarios
        repository = Path(scratch) / "models"
        stores = build_repository(repository, args.arch)
        kept = {key: Path(scratch) / "kept" / key for key in stores}
        for key, store in stores.items():  # what the publishing runs publish copies of
            shutil.copytree(store, kept[key])
        refs = references(stores, images)
        for scenario in scenarios:
            # By number: both versions on disk, loaded by number; by publishing, only
            # version 1: each swap publishes the other as the next version.
            shutil.rmtree(repository / "main")
            shutil.copytree(kept["main-1"], repository / "main" / "1")
            if scenario.how == "admin":
                shutil.copytree(kept["main-2"], repository / "main" / "2")
            runs.append(asyncio.run(one_run(scenario, kept, repository, images, refs, args)))
        summaries = report(runs)
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=2))
    ok = all(
        s["non_200"] == 0 and s["mismatched"] == 0 and s["worker_deaths"] == 0 for s in summaries
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
