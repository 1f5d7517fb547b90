"""``python -m bench.rollout``: versions swapped under load, in-process and in broker mode.

    python -m bench.rollout                          # 10 swaps, 32 clients, both modes
    python -m bench.rollout --modes inprocess --swaps 4 --json rollout.json

A model repository with one model (``main``) in two versions of different weights
(EfficientNet-Lite0 with its ImageNet weights, and with random ones), and a second model
(``other``) beside it. 32 closed-loop clients send distinct photos to ``main`` while it swaps
between its two versions ``--swaps`` times: in-process through the admin load route
(``POST /v2/repository/models/main/load``), in broker mode (``python -m app.broker.cluster``:
Redis, 2 gunicorn front ends, 2 workers) by publishing the other version as the next one and
``kill -HUP``. A second pass does the same while a quarter of the clients ask ``other``.

Every answer is checked against the reference vector of the version it says computed it
(``X-Model-Id``), computed here with TorchScript: cosine at least 0.999 (the runtimes agree
to 0.9999 or better; the two versions' vectors are nowhere near). Printed per run: answers by
status (anything but 200 is a failure) and by served id, answers that do not match their
id's reference (must be 0), p50/p99 latency while swapping against steady load, the time
from the load call (or the SIGHUP) to the switch, and every process's RSS after each swap,
with its growth after the first swap (flat within 5%).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from bench.loadgen import Connection, multipart_request
from bench.memory import Sample, rows, table

HOST = "127.0.0.1"
ADMIN_KEY = "bench-admin"
MIN_COSINE = 0.999
FLAT_PCT = 5.0


@dataclass
class Answer:
    sent_at: float
    latency_s: float
    status: int
    model: str  # the model asked
    served_id: str
    matched: bool


@dataclass
class Run:
    """What one run measured."""

    mode: str
    second_model: bool
    answers: list[Answer] = field(default_factory=list)
    swaps: list[tuple[float, float, float]] = field(default_factory=list)  # asked, switched, done
    samples: list[Sample] = field(default_factory=list)

    def swapping(self, at: float) -> bool:
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


def references(stores: dict[str, Path], images: list[bytes]) -> dict[str, npt.NDArray[np.float32]]:
    """served id -> each image's embedding under that version, by TorchScript here."""
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
        out[manifest.served_id("auto")] = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
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
        model = "other" if run.second_model and number % 4 == 3 else "main"
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
                matched = False
                if response.status == 200 and served in refs:
                    vector = np.frombuffer(response.body, dtype="<f4")
                    cosine = float(vector @ refs[served][image] / np.linalg.norm(vector))
                    matched = cosine >= MIN_COSINE
                run.answers.append(
                    Answer(sent, time.monotonic() - sent, response.status, model, served, matched)
                )
        finally:
            await connection.close()

    await asyncio.gather(*(client(i) for i in range(clients)))


def serving(port: int, name: str) -> str | None:
    """The served id ``name`` serves now, as the server's index says."""
    rows = httpx.get(f"http://{HOST}:{port}/v2/repository/index", timeout=10).json()
    return next((r["model_id"] for r in rows if r["name"] == name and r["serving"]), None)


def only(port: int, served_id: str, versions: set[str]) -> bool:
    """Whether every worker holds ``served_id`` and no other of ``versions`` (the swapped
    model's): the old version is unloaded everywhere."""
    workers = httpx.get(f"http://{HOST}:{port}/info", timeout=10).json()["workers"]
    held = [{m["served_id"] for m in w["models"]} & versions for w in workers]
    return bool(held) and all(ids == {served_id} for ids in held)


async def until(check: Any, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        await asyncio.sleep(0.1)


async def swap_in_process(port: int, version: int) -> None:
    """The admin route: answers once the version serves."""
    async with httpx.AsyncClient(timeout=600) as http:
        answer = await http.post(
            f"http://{HOST}:{port}/v2/repository/models/main/load",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            json={"parameters": {"version": str(version)}},
        )
    if answer.status_code != 200:
        raise RuntimeError(f"load failed: {answer.status_code} {answer.text}")


async def swap_broker(
    port: int, launcher_pid: int, repository: Path, source: Path, target_id: str
) -> None:
    """Publish ``source`` as ``main``'s next version, SIGHUP the workers, and wait until the
    front ends serve it."""
    from app.repository import publish, staging_folder

    staging = staging_folder(repository / "main")
    shutil.rmtree(staging)
    shutil.copytree(source, staging)
    publish(staging, repository / "main")
    os.kill(launcher_pid, signal.SIGHUP)
    await until(lambda: serving(port, "main") == target_id)


async def one_run(
    mode: str,
    second_model: bool,
    stores: dict[str, Path],
    repository: Path,
    images: list[bytes],
    refs: dict[str, npt.NDArray[np.float32]],
    args: argparse.Namespace,
) -> Run:
    from app.manifest import read_manifest
    from bench.systems import serve

    ids = {key: read_manifest(store).served_id("auto") for key, store in stores.items()}
    run = Run(mode, second_model)
    settings = {
        "MODEL_REPOSITORY": str(repository),
        "ADMIN_API_KEY": ADMIN_KEY,
        "LOG_LEVEL": "warning",
        **({"MB_MODEL_VERSIONS": "main=1"} if mode == "inprocess" else {}),
    }
    kind = {"inprocess": "ours", "broker": "cluster"}[mode]
    with serve(
        kind, stores["main-1"], batch_size="32", max_latency=0.005, threads=args.threads,
        workers=2, settings=settings, front_ends=2,
    ) as server:  # fmt: skip
        port = server.port
        await until(lambda: serving(port, "main") == ids["main-1"])
        stop = asyncio.Event()
        load = asyncio.create_task(drive(port, images, refs, run, stop, args.clients))
        await asyncio.sleep(args.steady_s)
        run.samples.append(Sample.take(server.process.pid, 0))
        for swap in range(1, args.swaps + 1):
            key = "main-2" if swap % 2 else "main-1"
            asked = time.monotonic()
            if mode == "inprocess":
                await swap_in_process(port, 2 if swap % 2 else 1)
            else:
                await swap_broker(port, server.process.pid, repository, stores[key], ids[key])
            switched = time.monotonic()
            main_ids = {ids["main-1"], ids["main-2"]}
            await until(partial(only, port, ids[key], main_ids))  # the old one unloaded
            run.swaps.append((asked, switched, time.monotonic()))
            run.samples.append(Sample.take(server.process.pid, swap))
            print(
                f"  {mode}{' + other' if second_model else ''}: swap {swap} to {ids[key]}: "
                f"switched after {switched - asked:.1f} s, old version unloaded "
                f"{time.monotonic() - switched:.1f} s later",
                flush=True,
            )
            await asyncio.sleep(args.steady_s)
        stop.set()
        await load
    return run


# -- the report -------------------------------------------------------------------------------


def percentiles(latencies: list[float]) -> str:
    if not latencies:
        return "-"
    ordered = sorted(latencies)

    def at(q: float) -> float:
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return f"{at(0.5):.0f}/{at(0.99):.0f}"


def summary(run: Run) -> dict[str, Any]:
    statuses = Counter(a.status for a in run.answers)
    by_id = Counter(a.served_id for a in run.answers if a.status == 200)
    mismatched = sum(1 for a in run.answers if a.status == 200 and not a.matched)
    steady = [a.latency_s for a in run.answers if not run.swapping(a.sent_at)]
    swapping = [a.latency_s for a in run.answers if run.swapping(a.sent_at)]
    switch_s = [switched - asked for asked, switched, _ in run.swaps]
    growth = []
    for row in rows(run.samples[1:]):  # after the first swap, against it
        growth.append((row.label, row.rss_growth_pct))
    worst = max((pct for _, pct in growth if pct is not None), default=0.0)
    return {
        "mode": run.mode,
        "second_model": run.second_model,
        "answers": len(run.answers),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "by_served_id": dict(by_id),
        "mismatched": mismatched,
        "latency_ms_steady_p50_p99": percentiles(steady),
        "latency_ms_swapping_p50_p99": percentiles(swapping),
        "switch_s_median": statistics.median(switch_s) if switch_s else None,
        "switch_s_max": max(switch_s, default=None),
        "rss_growth_after_first_swap_pct": dict(growth),
        "worst_growth_pct": worst,
        "non_200": sum(n for status, n in statuses.items() if status != 200),
    }


def report(runs: list[Run]) -> list[dict[str, Any]]:
    summaries = [summary(run) for run in runs]
    print(
        f"\nmodel rollouts ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    )
    head = (
        f"{'run':<22}{'answers':>9}{'non-200':>9}{'mismatch':>10}{'p50/p99 steady':>16}"
        f"{'p50/p99 swapping':>18}{'switch s (med/max)':>20}{'RSS growth max':>16}"
    )
    print(head)
    for s in summaries:
        name = f"{s['mode']}{' + other' if s['second_model'] else ''}"
        switch = f"{s['switch_s_median']:.1f}/{s['switch_s_max']:.1f}" if s["switch_s_max"] else "-"
        print(
            f"{name:<22}{s['answers']:>9}{s['non_200']:>9}{s['mismatched']:>10}"
            f"{s['latency_ms_steady_p50_p99']:>16}{s['latency_ms_swapping_p50_p99']:>18}"
            f"{switch:>20}{s['worst_growth_pct']:>15.1f}%"
        )
    for s, run in zip(summaries, runs, strict=True):
        name = f"{s['mode']}{' + other' if s['second_model'] else ''}"
        print(f"\n{name}: answers by served id {s['by_served_id']}, statuses {s['statuses']}")
        print(f"RSS in MB after the warm-up (0), then after each swap:\n{table(run.samples)}")
    verdicts = [
        ("every answer 200", all(s["non_200"] == 0 for s in summaries)),
        ("no answer mismatched its id", all(s["mismatched"] == 0 for s in summaries)),
        (
            f"RSS flat within {FLAT_PCT:g}% after the first swap",
            all(s["worst_growth_pct"] <= FLAT_PCT for s in summaries),
        ),
    ]
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
    parser.add_argument("--modes", default="inprocess,broker")
    parser.add_argument("--swaps", type=int, default=10)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--steady-s", type=float, default=5.0, help="load between swaps")
    parser.add_argument("--images", type=int, default=16, help="distinct photos")
    parser.add_argument("--arch", default="efficientnet_lite0")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="torch, in all")
    parser.add_argument("--no-second-model", dest="second", action="store_false")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from bench.systems import bench_jpegs

    images = bench_jpegs(args.images)
    runs = []
    with tempfile.TemporaryDirectory(prefix="microbatch-rollout-") as scratch:
        repository = Path(scratch) / "models"
        stores = build_repository(repository, args.arch)
        kept = {key: Path(scratch) / "kept" / key for key in stores}
        for key, store in stores.items():  # what the broker runs publish copies of
            shutil.copytree(store, kept[key])
        refs = references(stores, images)
        for mode in args.modes.split(","):
            for second in (False, True) if args.second else (False,):
                # In-process, both versions on disk, loaded by number; in broker mode, only
                # version 1: each swap publishes the other as the next version.
                shutil.rmtree(repository / "main")
                shutil.copytree(kept["main-1"], repository / "main" / "1")
                if mode == "inprocess":
                    shutil.copytree(kept["main-2"], repository / "main" / "2")
                runs.append(
                    asyncio.run(one_run(mode, second, kept, repository, images, refs, args))
                )
        summaries = report(runs)
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=2))
    ok = all(s["non_200"] == 0 and s["mismatched"] == 0 for s in summaries)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
