"""``python -m bench.dashboard``: the Grafana dashboard (deploy/grafana/microbatch.json) as a
picture, drawn from what a real Prometheus answered to every panel's queries while a real
server served a changing load (issue #37; no Grafana runs here, so matplotlib draws it).

    python -m bench.dashboard --out docs/dashboard.png                 # 90 s of load
    python -m bench.dashboard --out /tmp/dashboard.png --seconds 40

It exports EfficientNet-Lite0 (real weights) into a scratch model repository, starts the
server there (``python -m app`` on 127.0.0.1 with one worker, MB_MAX_QUEUE=96 and an admin
key) and Debian's ``prometheus`` scraping it every second (tests.prometheus, which the
dashboard tests use too), then drives the load through :data:`PHASES`:

- 1, 16 and 64 closed-loop clients, half ``/predict/tag`` and half ``/predict/embedding``
  (a client refused with 503 waits out its ``Retry-After``, as ``app.client`` does);
- 16 clients while uploads that are no image (400) and requests for an unknown model (404)
  trickle in, and a version 2 whose weights were altered after export is published and
  loaded through the admin API (it fails its sha256 check, 422; version 1 serves on);
- an overload: 256 clients against a queue of 96 (503 queue_full);
- 16 clients while the model worker is killed (SIGKILL) and restarted by its supervisor;
- no load at all.

Then each panel's queries, with every variable at All (``$across`` at its default, sum) and
Grafana's ``$__rate_interval`` as tests/prometheus.py sets it (10s), go to
``/api/v1/query_range`` at a 1 s step over the run; :mod:`bench.dashboard_plot` draws them
where the dashboard's grid puts them. It prints, per panel, each series' last, lowest and
highest value.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from app.repository import publish, staging_folder
from bench.dashboard_plot import (
    PanelData,
    PhaseSpan,
    Series,
    Values,
    draw,
    field_unit,
    format_value,
    legend_text,
)
from bench.loadgen import Connection, Response, closed_loop, multipart_request
from bench.systems import RunningServer, bench_jpegs, export_bench_model, serve
from tests.prometheus import (
    GRAFANA_VALUES,
    PrometheusServer,
    dashboard,
    label_values_query,
    panels,
    regex_escaped,
    substitute,
    variables,
)

HOST = "127.0.0.1"
MODEL = "efficientnet_lite0"
SECONDS = 90.0
STEP_S = 1
MAX_QUEUE = 96
ADMIN_KEY = "dashboard-admin"
NOT_AN_IMAGE = b"this is no image"
MAX_RETRY_WAIT_S = 10.0  # app.client's default


@dataclass(frozen=True)
class Phase:
    """A stretch of the load: ``share`` of the run's seconds with ``clients`` closed-loop
    clients, and what else happens in it."""

    name: str
    share: float
    clients: int
    bad_requests: bool = False  # 400s and 404s, a few a second
    broken_version: bool = False  # publish and load a version that fails to load
    kill_worker: bool = False


PHASES = (
    Phase("1 client", 0.13, 1),
    Phase("16 clients", 0.15, 16),
    Phase("64 clients", 0.15, 64),
    Phase("bad requests, failed load", 0.14, 16, bad_requests=True, broken_version=True),
    Phase("overload: 256 clients", 0.12, 256),
    Phase("worker killed", 0.15, 16, kill_worker=True),
    Phase("idle", 0.16, 0),
)


class RetryAfter:
    """A :class:`~bench.loadgen.Connection` whose client, as ``app.client`` does, waits out a
    503's ``Retry-After`` before its next request: a refused client comes back a second later
    instead of at once, so the refusals show at the rate real clients would cause."""

    def __init__(self, host: str, port: int) -> None:
        self.connection = Connection(host, port)

    async def send(self, request: bytes) -> Response:
        response = await self.connection.send(request)
        if response.status == 503:
            try:
                wait_s = float(response.headers.get("retry-after", "1"))
            except ValueError:
                wait_s = 1.0
            await asyncio.sleep(min(wait_s, MAX_RETRY_WAIT_S))
        return response

    async def close(self) -> None:
        await self.connection.close()


@dataclass(frozen=True)
class Target:
    """The running server, and the broken version waiting to be published beside its
    model's versions."""

    server: RunningServer
    model_folder: Path
    broken: Path

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.server.port}"


def model_repository(root: Path) -> tuple[Path, Path]:
    """``root/MODEL/1``: the export; and a staging folder beside it holding a copy whose
    weights changed after export (each ``embedding*`` file), which fails the load's sha256
    check once published."""
    model_folder = root / MODEL
    store = export_bench_model(MODEL, model_folder / "1")
    broken = staging_folder(model_folder)
    shutil.copytree(store, broken, dirs_exist_ok=True)
    for path in broken.rglob("embedding*"):
        with path.open("ab") as handle:
            handle.write(b"altered")
    return model_folder, broken


def load_broken_version(target: Target) -> str:
    number = publish(target.broken, target.model_folder)
    answer = httpx.post(
        f"{target.base_url}/v2/repository/models/{MODEL}/load",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=120,
    )
    return f"version {number} published, admin load answered {answer.status_code}"


def kill_worker(target: Target) -> str:
    workers = httpx.get(f"{target.base_url}/readyz", timeout=10).json()["workers"]
    pid = int(workers[0]["pid"])
    os.kill(pid, signal.SIGKILL)
    return f"model worker pid {pid} killed"


async def bad_requests(target: Target, jpeg: bytes, until: float) -> Counter[int]:
    """One request every 0.1 s until ``until``: an upload that is no image, then an image
    for a model that does not exist, in turns."""
    port = target.server.port
    requests = [
        multipart_request(HOST, port, "/predict/tag", NOT_AN_IMAGE),
        multipart_request(HOST, port, "/predict/tag?model=no-such-model", jpeg),
    ]
    connection, statuses = Connection(HOST, port), Counter[int]()
    try:
        for n in itertools.count():
            if time.monotonic() >= until:
                break
            statuses[(await connection.send(requests[n % 2])).status] += 1
            await asyncio.sleep(0.1)
    finally:
        await connection.close()
    return statuses


async def run_phase(
    phase: Phase, target: Target, requests: Sequence[bytes], jpeg: bytes, seconds: float
) -> tuple[Counter[int], list[str]]:
    """``phase`` for ``seconds``: the answers' statuses (0: no answer) and what was done."""
    until = time.monotonic() + seconds
    statuses: Counter[int] = Counter()
    notes: list[str] = []

    async def load() -> None:
        if phase.clients:
            port = target.server.port
            result = await closed_loop(
                HOST,
                port,
                requests,
                clients=phase.clients,
                duration_s=seconds,
                connect=lambda: RetryAfter(HOST, port),
            )
            statuses.update(result.statuses)
        else:
            await asyncio.sleep(seconds)

    async def aside() -> None:
        # A second into the phase, so that its load is already flowing.
        await asyncio.sleep(min(1.0, seconds / 4))
        if phase.broken_version:
            notes.append(await asyncio.to_thread(load_broken_version, target))
        if phase.kill_worker:
            notes.append(await asyncio.to_thread(kill_worker, target))
        if phase.bad_requests:
            statuses.update(await bad_requests(target, jpeg, until))

    await asyncio.gather(load(), aside())
    return statuses, notes


def drive(target: Target, seconds: float, began: float) -> list[PhaseSpan]:
    """Every phase, one after another; their spans in seconds since ``began`` (Unix time)."""
    jpegs = bench_jpegs()
    port = target.server.port
    requests = [
        multipart_request(HOST, port, f"/predict/{task}", jpeg)
        for jpeg in jpegs
        for task in ("tag", "embedding")
    ]
    spans = []
    for phase in PHASES:
        start = time.time()
        statuses, notes = asyncio.run(
            run_phase(phase, target, requests, jpegs[0], phase.share * seconds)
        )
        spans.append(PhaseSpan(phase.name, start - began, time.time() - began))
        answered = ", ".join(f"{status}: {n}" for status, n in sorted(statuses.items()))
        print(f"{phase.name:>26}: {answered or 'no requests'}", *notes, sep="; ", flush=True)
    return spans


def all_values(prometheus: PrometheusServer, board: Mapping[str, Any]) -> dict[str, str]:
    """The dashboard's variables as Grafana sets them with All selected: a query variable's
    ``allValue``, else every value it lists, joined as a regex; a custom variable's current
    value; Grafana's own ``$__rate_interval`` and the like as tests.prometheus sets them."""
    values = dict(GRAFANA_VALUES)
    for variable in variables(board):
        name = variable["name"]
        if variable["type"] == "custom":
            values[name] = str(variable["current"]["value"])
        elif variable["type"] == "query":
            asked = label_values_query(variable)
            assert asked is not None, f"${name} is not a label_values() query"
            listed = prometheus.label_values(substitute(asked[0], values), asked[1])
            joined = "(" + "|".join(map(regex_escaped, listed)) + ")"
            values[name] = variable.get("allValue") or joined
    return values


def fetch(
    prometheus: PrometheusServer, board: Mapping[str, Any], began: float, ended: float
) -> tuple[Values, list[PanelData]]:
    """Every panel's series over [began, ended] (Unix times) at STEP_S, on one time grid in
    seconds since ``began``."""
    values = all_values(prometheus, board)
    grid = np.arange(began, ended + STEP_S / 2, STEP_S, dtype=np.float64)
    drawn = []
    for panel in panels(board):
        series = []
        for target in panel.get("targets", []):
            matrix = prometheus.api(
                "query_range",
                query=substitute(target["expr"], values),
                start=f"{grid[0]:.3f}",
                end=f"{grid[-1]:.3f}",
                step=f"{STEP_S}s",
            )
            for result in matrix["result"]:
                aligned = np.full(len(grid), np.nan)
                for at, value in result["values"]:
                    aligned[round((float(at) - grid[0]) / STEP_S)] = float(value)
                # +Inf (a ratio over a zero rate) draws nothing, as in Grafana: a gap.
                aligned[np.isinf(aligned)] = np.nan
                legend = legend_text(target.get("legendFormat", ""), result["metric"])
                series.append(Series(target["refId"], legend, aligned))
        drawn.append(PanelData(panel, series))
    return grid - began, drawn


def summary(panels_drawn: Sequence[PanelData]) -> list[str]:
    """Per panel: how many series, and each one's last, lowest and highest value."""
    lines = []
    for data in panels_drawn:
        lines.append(f"{data.panel['title']}: {len(data.series)} series")
        if data.panel["type"] == "heatmap":
            # Each cell counts the calls of the window before it, so the windows overlap;
            # the shares of the buckets hold all the same.
            buckets = sorted(data.series, key=lambda series: float(series.legend))
            totals = np.diff([float(np.nansum(s.values)) for s in buckets], prepend=0.0)
            shares = ", ".join(
                f"le {float(s.legend):g}: {share:.0%}"
                for s, share in zip(buckets, totals / max(totals.sum(), 1e-12), strict=True)
                if share >= 0.005
            )
            lines.append(f"    share of model calls by bucket over the run: {shares}")
            continue
        for series in data.series:
            unit = field_unit(data.panel, series.ref_id)[0]
            known = series.values[~np.isnan(series.values)]
            last = float(known[-1]) if len(known) else float("nan")
            low, peak = (float(known.min()), float(known.max())) if len(known) else (last, last)
            lines.append(
                f"    {series.legend}: last {format_value(last, unit)}, "
                f"low {format_value(low, unit)}, peak {format_value(peak, unit)}"
            )
    return lines


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dashboard", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    parser.add_argument("--seconds", type=float, default=SECONDS, help="of load, all phases")
    parser.add_argument("--threads", type=int, default=2, help="the model worker's")
    parser.add_argument("--dpi", type=int, default=90)
    args = parser.parse_args(argv)
    if shutil.which("prometheus") is None:
        print("prometheus is not installed (apt-get install prometheus)", file=sys.stderr)
        return 1
    board = dashboard()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mb-dashboard-") as scratch:
        model_folder, broken = model_repository(Path(scratch) / "models")
        settings = {
            "MODEL_REPOSITORY": str(model_folder.parent),
            "ADMIN_API_KEY": ADMIN_KEY,
            "MB_MAX_QUEUE": str(MAX_QUEUE),
        }
        with (
            serve(
                "ours",
                model_folder / "1",
                batch_size="32",
                max_latency=0.005,
                threads=args.threads,
                settings=settings,
            ) as server,
            PrometheusServer([f"{HOST}:{server.port}"]) as prometheus,
        ):
            target = Target(server, model_folder, broken)
            prometheus.scraped_after(time.time())
            began = time.time()
            spans = drive(target, args.seconds, began)
            ended = time.time()
            prometheus.scraped_after(ended + 2)
            times_s, drawn = fetch(prometheus, board, began - 5, ended + 2)
    times_s -= 5  # the grid began 5 s before the load
    subtitle = (
        f"{MODEL}, 1 worker x {args.threads} threads, {cpu_model()}, "
        f"{time.strftime('%Y-%m-%d')}: python -m bench.dashboard --seconds {args.seconds:g}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    window = GRAFANA_VALUES["__rate_interval"]
    draw(board, drawn, times_s, spans, args.out, subtitle=subtitle, window=window, dpi=args.dpi)
    took = time.monotonic() - started
    for line in summary(drawn):
        print(line)
    empty = [data.panel["title"] for data in drawn if not data.series]
    print(
        f"{len(drawn)} panels, {len(empty)} without data{': ' if empty else ''}" + "; ".join(empty)
    )
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB) in {took:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
