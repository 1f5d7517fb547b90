"""deploy/grafana/microbatch.json and deploy/prometheus/rules.yaml, without a server: every
metric and label they read is one app.metrics exports (a rename breaks this test even where
Prometheus is not installed), the dashboard is a Grafana model whose panels all read the
templated data source, every alert says how bad and what to do, and promtool accepts the
rules and passes their unit tests (rules.test.yaml). The queries against a real Prometheus:
tests/integration/test_dashboard.py."""

from __future__ import annotations

import functools
import re
import subprocess
from collections.abc import Iterator

import pytest

from app.batching import WorkerStatus
from app.cache import ResponseCache
from app.errors import BrokerUnavailable, ClientDisconnected, InvalidImage, QueueFull
from app.jobs import Task
from app.metrics import LATENCY_BUCKETS, LOAD_BUCKETS, BatchRun, LiveState, Metrics, VersionState
from tests.prometheus import (
    RULES,
    RULES_TEST,
    TARGET_LABELS,
    Query,
    dashboard,
    label_values_query,
    metric_names,
    panel_queries,
    panels,
    require_tool,
    rule_queries,
    rules,
    variables,
    with_bool,
)
from tests.server import REPO

GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range"}
SEVERITIES = {"critical", "warning", "info"}


class _Report:
    """A broker worker's heartbeat (``app.metrics.WorkerReport``): one batch of 2 run, one
    load ended and one failed."""

    def __init__(self) -> None:
        self.sizes = {"tiny@1": {Task.TAG: {2: 1}}}
        # Each bucket's count (the +Inf one included), then the sum.
        self.model_s = {"tiny@1": {Task.TAG: [1.0] * (len(LATENCY_BUCKETS) + 1) + [0.01]}}
        self.wait_s = self.model_s
        self.size_s = {"tiny@1": {Task.TAG: {2: 0.01}}}
        self.tenant_wait_s = {"shop": self.model_s["tiny@1"][Task.TAG]}
        self.reclaimed, self.reconnects, self.shared = 1, 1, 1
        self.name, self.pid, self.life = "h:0", 1, "0a"
        self.load_s = {"tiny": [1.0] * (len(LOAD_BUCKETS) + 1) + [1.0]}
        self.load_failures = {"tiny": {"verify": 1}}


@functools.cache
def _exported(remote_workers: bool) -> dict[str, set[str]]:
    """Each sample name /metrics carries, with its label names: a Metrics that has seen one
    event of each kind, with a worker and a version in its live state."""
    from prometheus_client.parser import text_string_to_metric_families

    metrics = Metrics(remote_workers=remote_workers)
    metrics.labels = lambda served_id: ("tiny", "1")
    worker = WorkerStatus(
        index=0, device="cpu", threads=1, pid=1, ready=True, alive=True, batch_size=8,
        batches=1, items=2, rss_bytes=1 << 20, cpu_seconds=1.5, restarts=1,
    )  # fmt: skip
    version = VersionState("tiny", 1, "tiny@1", "ready", serving=False)
    metrics.watch(
        lambda: LiveState(queue_depth=1, in_flight=1, workers=[worker], versions=[version])
    )
    metrics.on_request("/predict/tag", 200, 0.01, "tiny", "1", inference=True)
    for error in (QueueFull, InvalidImage, ClientDisconnected, BrokerUnavailable):
        metrics.on_error(error)
    metrics.on_tenant_images("shop", 2, True)
    metrics.on_error(QueueFull, "shop")
    metrics.watch_cache(ResponseCache(1 << 20))
    metrics.on_cache("hit")
    if remote_workers:
        metrics.on_workers([_Report()])
        metrics.on_broker_event("reconnect")
    else:
        metrics.on_load("tiny", 2, 1.0, None)
        metrics.on_load("tiny", 3, 1.0, "verify")
        metrics.on_batch("tag", 2, [0.001, 0.002], "tiny", "1")
        metrics.on_tenant_waits([0.001, 0.002], ["shop", None])
        metrics.on_run(BatchRun(task="tag", size=2, compute_s=0.01, threads=1), "tiny", "1")
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


MODES = {"in-process": False, "broker": True}


def _all_queries() -> list[Query]:
    board = dashboard()
    found = panel_queries(board) + rule_queries(rules())
    for variable in variables(board):
        asked = label_values_query(variable)
        if asked is not None:
            found.append(Query(f"variable ${variable['name']}", asked[0]))
    return found


def _labels_named(expr: str) -> Iterator[tuple[str, str | None]]:
    """(label, metric) for each label a selector matches on (with its metric), and (label,
    None) for each one a by/without clause names."""
    for metric, matchers in re.findall(r"\b([a-z_][a-z0-9_]*)\s*\{([^}]*)\}", expr):
        for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", re.sub(r'"[^"]*"', '""', matchers)):
            yield label, metric
    for clause in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        for label in re.findall(r"\w+", clause):
            yield label, None


@pytest.mark.parametrize("mode", list(MODES))
def test_every_metric_the_dashboard_and_rules_read_is_exported(mode: str) -> None:
    exported = _exported(MODES[mode])
    missing = [
        f"{query.where}: {name}"
        for query in _all_queries()
        for name in sorted(metric_names(query.expr))
        if name not in exported
    ]
    assert missing == [], f"not exported by app.metrics ({mode}): {missing}"
    assert all(metric_names(query.expr) for query in _all_queries())


def test_every_label_they_use_is_one_those_metrics_carry() -> None:
    exported = _exported(False)
    problems = []
    board = dashboard()
    legends = {
        f"panel {panel['title']!r} {target['refId']}": target.get("legendFormat", "")
        for panel in panels(board)
        for target in panel.get("targets", [])
    }
    annotations = {
        f"alert {rule['alert']}": " ".join(rule.get("annotations", {}).values())
        for group in rules()["groups"]
        for rule in group["rules"]
    }
    for query in _all_queries():
        carried = TARGET_LABELS.union(*(exported.get(n, set()) for n in metric_names(query.expr)))
        for label, metric in _labels_named(query.expr):
            allowed = carried if metric is None else TARGET_LABELS | exported.get(metric, set())
            if label not in allowed:
                problems.append(f"{query.where}: {label} ({metric or 'by/without'})")
        shown = re.findall(r"\{\{\s*(\w+)\s*\}\}", legends.get(query.where, ""))
        shown += re.findall(r"\$labels\.(\w+)", annotations.get(query.where, ""))
        problems += [f"{query.where}: shows {label}" for label in shown if label not in carried]
    assert problems == []


# What the model workers count: in broker mode every front end reports each of them.
WORKER_REPORTED = re.compile(
    r"microbatch_(batch_size|queue_wait_seconds|model_seconds|model_load_\w+|worker_\w+)"
)


def test_a_panel_adding_up_what_workers_count_takes_one_front_ends_view() -> None:
    """A panel that adds up an amount the workers count goes through ``$across`` (max in
    broker mode, where every front end reports every worker): 'Model load failures' summed
    them over the front ends, and showed twice the failures with two. A quantile, a ratio
    or a max of them is the same from any number of front ends."""
    for query in panel_queries(dashboard()):
        expr = query.expr
        if not WORKER_REPORTED.search(expr) or "$across" in expr:
            continue
        assert expr.startswith(("histogram_quantile(", "max by")) or " / " in expr, query


def test_the_dashboard_is_a_grafana_model_on_a_templated_prometheus() -> None:
    board = dashboard()
    assert 36 <= board["schemaVersion"] <= 41 and board["uid"] and board["title"]
    by_name = {variable["name"]: variable for variable in variables(board)}
    assert by_name["datasource"]["type"] == "datasource"
    assert by_name["datasource"]["query"] == "prometheus"
    assert {"job", "model"} <= set(by_name)
    source = {"type": "prometheus", "uid": "${datasource}"}
    ids = [panel["id"] for panel in board["panels"]] + [
        panel["id"] for row in board["panels"] for panel in row.get("panels", [])
    ]
    assert len(ids) == len(set(ids)), "two panels share an id"
    for panel in panels(board):
        assert panel["datasource"] == source, panel["title"]
        assert panel["targets"], f"{panel['title']} has no query"
        assert panel.get("description"), f"{panel['title']} does not say what it shows"
        for target in panel["targets"]:
            assert target.get("datasource", source) == source, panel["title"]
    for variable in by_name.values():
        if variable["type"] == "query":
            assert variable["datasource"] == source and label_values_query(variable)
    for query in _all_queries():
        used = set(re.findall(r"\$\{?(\w+)", query.expr))
        assert used <= set(by_name) | GRAFANA_BUILTINS, f"{query.where}: {used}"


def test_the_dashboard_covers_what_issue_37_asks() -> None:
    read = {name for query in panel_queries(dashboard()) for name in metric_names(query.expr)}
    assert {
        "microbatch_http_requests_total",
        "microbatch_batch_size_sum",
        "microbatch_batch_size_bucket",
        "microbatch_http_request_duration_seconds_bucket",
        "microbatch_queue_wait_seconds_bucket",
        "microbatch_rejected_total",
        "microbatch_workers_alive",
        "microbatch_workers_ready",
        "microbatch_worker_restarts_total",
        "microbatch_model_versions",
        "microbatch_model_load_failures_total",
        "microbatch_queue_depth",
        "process_cpu_seconds_total",
        "microbatch_worker_memory_bytes",
    } <= read


def test_every_alert_has_a_for_a_severity_and_says_what_to_do() -> None:
    seen = []
    for group in rules()["groups"]:
        for rule in group["rules"]:
            name = rule["alert"]
            seen.append(name)
            assert re.fullmatch(r"\d+[smh]", str(rule.get("for", ""))), f"{name}: no for:"
            assert rule["labels"]["severity"] in SEVERITIES, name
            assert {"summary", "description"} <= set(rule["annotations"]), name
            # A comparison with a threshold: what tests/integration/test_dashboard.py turns
            # into `bool` to see the series of a healthy server.
            assert with_bool(rule["expr"]) != rule["expr"], f"{name}: no threshold"
    assert len(seen) == len(set(seen))
    tested = RULES_TEST.read_text()
    untested = [name for name in seen if f"alertname: {name}," not in tested]
    assert untested == [], "rules.test.yaml has no test for these"


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_tool("promtool"), *args], capture_output=True, text=True, timeout=120
    )


def test_promtool_accepts_the_rules() -> None:
    checked = _promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_each_alert_fires_on_its_synthetic_series_and_none_when_healthy() -> None:
    tested = _promtool("test", "rules", str(RULES_TEST))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_with_bool_leaves_label_matchers_alone() -> None:
    expr = 'x{a!="1", b=~"2", c!~"3"} != 0'
    assert with_bool(expr) == 'x{a!="1", b=~"2", c!~"3"} != bool 0'
    assert with_bool("a > bool 1") == "a > bool 1"


def test_make_test_installs_prometheus_as_it_installs_redis() -> None:
    """What these tests and tests/integration/test_dashboard.py need comes with `make test`
    (as root with apt-get: CI's fresh clone), as redis-server does."""
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^test: .*\bredis-server\b.*\bprometheus\b", makefile, re.M)
    recipe = makefile.split("\nprometheus:\n", 1)[1].split("\n\n", 1)[0]
    assert "apt-get install -y -qq" in recipe and "prometheus" in recipe
    assert "CI_REQUIRE_REDIS=1" in (REPO / ".ci" / "run").read_text()


def test_the_dashboard_shows_each_tenant_as_issue_50_asks() -> None:
    board = dashboard()
    assert "tenant" in {variable["name"] for variable in variables(board)}
    tenant_queries = [q for q in panel_queries(board) if 'tenant=~"$tenant"' in q.expr]
    read = {name for query in tenant_queries for name in metric_names(query.expr)}
    assert {
        "microbatch_tenant_images_total",
        "microbatch_tenant_refused_total",
        "microbatch_tenant_queue_wait_seconds_bucket",
    } <= read
