"""The dashboard is proven, not drawn (issue #37): a real Prometheus scrapes a real server
every second while it serves a short load (both tasks, a bad image, an overload, a failed
model load), then every panel query of deploy/grafana/microbatch.json, every variable's
label_values and every rule of deploy/prometheus/rules.yaml runs through Prometheus's HTTP
API, and each must answer without an error and with at least one series. An alert's
comparison gets ``bool`` (``> 1`` becomes ``> bool 1``) so that a healthy server returns its
series too. Prometheus also loads the rules itself, and each must evaluate without an error.

The same in broker mode (redis-server, a model worker, a front end), where the backlog in
Redis must show on the dashboard: the workers are paused while requests arrive.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.repository import publish, staging_folder
from tests.broker import RedisServer, Workers, broker_env
from tests.conftest import distinct_images
from tests.models import export_scaled
from tests.prometheus import (
    GRAFANA_VALUES,
    RULES,
    PrometheusError,
    PrometheusServer,
    Query,
    dashboard,
    label_values_query,
    metric_names,
    panel_queries,
    regex_escaped,
    require_tool,
    rule_queries,
    rules,
    substitute,
    variables,
    with_bool,
)
from tests.server import ServerProcess

pytestmark = pytest.mark.slow

ADMIN_KEY = "admin-secret"
IMAGES = distinct_images(16, size=40)
# Without a keys file, a broker front end has no tenant's queue wait: its workers time each
# tenant's in its lane, and without a keys file the callers of a level share one
# (tests/integration/test_broker_priorities.py reads it with one).
IN_PROCESS_ONLY = frozenset({"microbatch_tenant_queue_wait_seconds_bucket"})


def combinations(prometheus: PrometheusServer) -> list[dict[str, str]]:
    """The values to run the panels with: each option of a custom variable; for a query
    variable, All (its allValue, else every value it lists, as Grafana joins them) and its
    first value. Each variable's own query must list something."""
    choices: list[list[tuple[str, str]]] = []
    resolved = dict(GRAFANA_VALUES)
    for variable in variables(dashboard()):
        name, kind = variable["name"], variable["type"]
        if kind == "custom":
            options = [str(option["value"]) for option in variable["options"]]
        elif kind == "query":
            asked = label_values_query(variable)
            assert asked is not None, f"${name} is not a label_values() query"
            selector = substitute(asked[0], resolved)
            listed = prometheus.label_values(selector, asked[1])
            assert listed, f"${name}: label_values({selector}, {asked[1]}) lists nothing"
            joined = "(" + "|".join(map(regex_escaped, listed)) + ")"
            options = [variable.get("allValue") or joined, regex_escaped(listed[0])]
        else:
            continue
        resolved[name] = options[0]
        choices.append([(name, option) for option in options])
    return [{**GRAFANA_VALUES, **dict(combo)} for combo in itertools.product(*choices)]


def unanswered(
    prometheus: PrometheusServer, at: float, skip: frozenset[str] = frozenset()
) -> list[str]:
    """Each panel query (with every combination of variable values) and each rule
    expression (with ``bool``) that Prometheus answers at ``at`` with an error or no series."""
    runs: list[tuple[Query, str]] = [
        (query, substitute(query.expr, values))
        for values in combinations(prometheus)
        for query in panel_queries(dashboard())
    ]
    runs += [(query, with_bool(query.expr)) for query in rule_queries(rules())]
    problems = []
    for query, expr in runs:
        if metric_names(expr) & skip:
            continue
        try:
            if not prometheus.query(expr, at=at):
                problems.append(f"{query.where}: no series: {expr}")
        except PrometheusError as error:
            problems.append(f"{query.where}: {error}: {expr}")
    return problems


def rules_evaluated(prometheus: PrometheusServer, timeout_s: float = 30) -> list[dict[str, Any]]:
    """Prometheus's own evaluation of rules.yaml, once every rule has run at least once."""
    deadline = time.monotonic() + timeout_s
    while True:
        loaded = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
        if loaded and all(rule["health"] != "unknown" for rule in loaded):
            return loaded
        if time.monotonic() > deadline:
            raise AssertionError(f"the rules were not all evaluated: {loaded}")
        time.sleep(0.2)


async def post(client: httpx.AsyncClient, task: str, image: bytes, fresh: bool = False) -> int:
    """``fresh``: past the response cache (the load repeats its images: they are hits)."""
    headers = {"Cache-Control": "no-cache"} if fresh else {}
    answer = await client.post(
        f"/predict/{task}", files={"image": ("x.png", image)}, headers=headers
    )
    return answer.status_code


async def steady_load(base_url: str, seconds: float, clients: int) -> Counter[int]:
    """``clients`` closed-loop clients for ``seconds``, alternating tags and embeddings."""
    statuses: Counter[int] = Counter()
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:

        async def one(first: int) -> None:
            for n in itertools.count(first):
                if time.monotonic() > deadline:
                    return
                task = ("tag", "embedding")[n % 2]
                statuses[await post(client, task, IMAGES[n % len(IMAGES)])] += 1

        await asyncio.gather(*(one(i) for i in range(clients)))
    return statuses


async def burst(base_url: str, requests: int) -> Counter[int]:
    """``requests`` at once: more than MB_MAX_QUEUE, so some are refused 503 (each asks
    past the cache, which would answer the repeats)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        answers = await asyncio.gather(
            *(post(client, "embedding", IMAGES[n % len(IMAGES)], True) for n in range(requests))
        )
    return Counter(answers)


async def no_images(base_url: str) -> Counter[int]:
    """Three uploads that are no image, one after the other: 400."""
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        return Counter([await post(client, "tag", b"this is no image") for _ in range(3)])


@pytest.fixture
def repository(tiny_store: Path, tmp_path: Path) -> Path:
    """A model repository where tiny/1, the tiny test model, serves."""
    root = tmp_path / "models"
    shutil.copytree(tiny_store, root / "tiny" / "1")
    return root


def add_broken_version(repository: Path) -> None:
    """tiny/2: another export, published as the export CLI does, whose weights changed
    afterwards: loading it fails its sha256 check (step verify)."""
    staging = staging_folder(repository / "tiny")
    export_scaled(staging, 2.0)
    with (staging / "embedding.pt").open("ab") as handle:
        handle.write(b"tampered")
    publish(staging, repository / "tiny")


def admin_load(base_url: str) -> httpx.Response:
    """Ask the server to load tiny's newest version."""
    return httpx.post(
        f"{base_url}/v2/repository/models/tiny/load",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=60,
    )


async def test_every_panel_and_rule_answers_for_an_in_process_server(repository: Path) -> None:
    require_tool("prometheus")  # before starting a server for nothing
    env = {
        "MODEL_REPOSITORY": str(repository),
        "ADMIN_API_KEY": ADMIN_KEY,
        "MB_WORKER_NUM": "1",
        "MB_MAX_QUEUE": "2",
        "MB_CACHE_BYTES": "8MiB",
    }
    with ServerProcess(**env) as server:
        with PrometheusServer([f"127.0.0.1:{server.port}"], rule_files=[RULES]) as prometheus:
            add_broken_version(repository)
            load = admin_load(server.base_url)
            assert load.status_code == 422, load.text  # verify failed; version 1 serves on
            statuses = await steady_load(server.base_url, seconds=5, clients=4)
            statuses += await burst(server.base_url, requests=64)
            statuses += await no_images(server.base_url)
            ended = time.time()
            assert statuses[200] and statuses[400] and statuses[503], statuses
            prometheus.scraped_after(ended + 2)
            problems = unanswered(prometheus, at=ended + 1)
            evaluated = rules_evaluated(prometheus)
            shown = {
                what: prometheus.query(expr)
                for what, expr in {
                    "refusals": "sum by (reason) (microbatch_rejected_total)",
                    "failures": "sum by (step) (microbatch_model_load_failures_total)",
                    "versions": "max by (state) (microbatch_model_versions)",
                }.items()
            }
    assert problems == []
    assert [(r["name"], r["lastError"]) for r in evaluated if r["health"] != "ok"] == []
    # The failed load fires its alert at once; the failed version's waits out its for:.
    states = {rule["name"]: rule["state"] for rule in evaluated}
    assert states["MicrobatchModelLoadFailed"] == "firing", states
    assert states["MicrobatchModelVersionFailed"] == "pending", states
    assert states["MicrobatchNoReadyWorker"] == "inactive", states
    # What happened shows: the refusals by their reason, the failed load by its step and
    # the version it left failed.
    assert {s["metric"]["reason"] for s in shown["refusals"]} >= {"bad_input", "queue_full"}
    assert [s["metric"]["step"] for s in shown["failures"]] == ["verify"]
    assert {s["metric"]["state"] for s in shown["versions"]} == {"ready", "failed"}


async def test_every_panel_and_rule_answers_in_broker_mode_and_shows_the_backlog(
    repository: Path,
) -> None:
    require_tool("prometheus")
    store, served = repository / "tiny" / "1", str(repository)
    with (
        RedisServer() as redis_server,
        Workers(redis_server, store, MODEL_REPOSITORY=served) as workers,
    ):
        front = ServerProcess(
            **broker_env(
                redis_server.url,
                store,
                MODEL_REPOSITORY=served,
                ADMIN_API_KEY=ADMIN_KEY,
                MB_MAX_QUEUE="4",
                MB_CACHE_BYTES="8MiB",
                MB_CACHE_REDIS=redis_server.url,
            )
        )
        with front, PrometheusServer([f"127.0.0.1:{front.port}"], rule_files=[RULES]) as prometheus:
            add_broken_version(repository)
            assert admin_load(front.base_url).status_code == 422  # the workers' verify failed
            statuses = await steady_load(front.base_url, seconds=5, clients=4)
            statuses += await no_images(front.base_url)
            # Requests arrive while the worker is paused (as if busy): they wait in the shared
            # streams, and those that find the front end's queue full are refused. Again if
            # no scrape saw it.
            backlog: list[dict[str, Any]] = []
            (worker,) = workers.live().values()
            for _ in range(3):
                with workers.paused(worker):
                    waiting = asyncio.ensure_future(burst(front.base_url, requests=16))
                    await asyncio.sleep(1.2)
                statuses += await waiting
                seen = time.time()
                prometheus.scraped_after(seen + 1)
                backlog = prometheus.query("max_over_time(microbatch_queue_depth[10s]) > 0")
                if backlog:
                    break
            ended = time.time()
            assert statuses[200] and statuses[400] and statuses[503], statuses
            assert backlog, "no scrape saw the requests waiting in Redis"
            prometheus.scraped_after(ended + 2)
            problems = unanswered(prometheus, at=ended + 1, skip=IN_PROCESS_ONLY)
            evaluated = rules_evaluated(prometheus)
            # The dashboard's backlog panel, as it would have drawn the last minute.
            waiting_panels = [
                query
                for query in panel_queries(dashboard())
                if "microbatch_queue_depth" in query.expr and "deriv" not in query.expr
            ]
            assert waiting_panels
            peaks = {
                f"{query.where} {values}": prometheus.query(
                    f"max_over_time(({substitute(query.expr, values)})[1m:1s])", at=ended + 1
                )
                for query in waiting_panels
                for values in combinations(prometheus)
            }
            versions = prometheus.query("max by (state) (microbatch_model_versions)")
            counted = prometheus.query("microbatch_model_load_failures_total")
    assert problems == []
    assert [(r["name"], r["lastError"]) for r in evaluated if r["health"] != "ok"] == []
    states = {rule["name"]: rule["state"] for rule in evaluated}
    assert states["MicrobatchModelLoadFailed"] == "firing", states
    assert states["MicrobatchModelVersionFailed"] == "pending", states
    assert states["MicrobatchNoReadyWorker"] == "inactive", states
    # The failed load shows as a failed version, and in the counter its worker's heartbeat
    # carries to the front end, as an in-process server counts it.
    assert {s["metric"]["state"] for s in versions} == {"ready", "failed"}
    failed = [(s["metric"]["step"], float(s["value"][1])) for s in counted]
    assert failed == [("verify", 1.0)], counted
    # The backlog panel drew the requests that waited in Redis, whatever the variables.
    assert all(series and float(series[0]["value"][1]) > 0 for series in peaks.values()), peaks
