"""The Grafana dashboard (deploy/grafana/microbatch.json) and the alerting rules
(deploy/prometheus/rules.yaml) as PromQL to run, and a real Prometheus to run it on: Debian's
``prometheus`` package, which ``make test`` installs (``make prometheus``).

>>> with_bool("sum(rate(x[5m])) > 1")
'sum(rate(x[5m])) > bool 1'
>>> with_bool('(a or 0 * b) == 0 and c{le="0.5"} >= 0.5 * 30')
'(a or 0 * b) == bool 0 and c{le="0.5"} >= bool 0.5 * 30'
>>> substitute("rate(x{job=~\\"$job\\"}[$__rate_interval])", {"job": "a|b", "__rate_interval": "10s"})
'rate(x{job=~"a|b"}[10s])'
>>> print(regex_escaped("tiny-test.v1"))
tiny-test\\\\.v1
>>> sorted(metric_names('sum(rate(microbatch_rejected_total{reason="x"}[1m])) / process_cpu_seconds_total'))
['microbatch_rejected_total', 'process_cpu_seconds_total']
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.children import start
from tests.server import REPO, ChildProcess, free_port

DASHBOARD = REPO / "deploy" / "grafana" / "microbatch.json"
RULES = REPO / "deploy" / "prometheus" / "rules.yaml"
RULES_TEST = REPO / "deploy" / "prometheus" / "rules.test.yaml"
SCRAPE_S = 1
# What Grafana puts for its own variables; the windows span a few scrapes of SCRAPE_S.
GRAFANA_VALUES = {"__rate_interval": "10s", "__interval": "5s", "__range": "5m"}
# The labels Prometheus gives every scraped series (the Operator adds pod, namespace...).
TARGET_LABELS = frozenset({"job", "instance"})

# A comparison with a number (or a product of numbers) on its right, not already `bool`.
_COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)(\s*)(?!bool\b)(?=[0-9.])")
_METRIC = re.compile(r"\b(?:microbatch|process)_[a-z0-9_]+\b")
_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


def require_tool(name: str) -> str:
    """The ``prometheus`` or ``promtool`` binary; the test skips without it, except where CI
    demands it (``.ci/run`` sets ``CI_REQUIRE_REDIS=1`` and ``make test`` installs it)."""
    binary = shutil.which(name)
    if binary is None:
        message = f"{name} is not installed (make test installs it: apt-get install prometheus)"
        if os.environ.get("CI_REQUIRE_REDIS"):
            pytest.fail(message)
        pytest.skip(message)
    return binary


@dataclass(frozen=True)
class Query:
    """One PromQL expression of the dashboard or the rules; ``where`` names it."""

    where: str
    expr: str


def dashboard() -> dict[str, Any]:
    loaded = json.loads(DASHBOARD.read_text())
    assert isinstance(loaded, dict)
    return loaded


def rules() -> dict[str, Any]:
    loaded = yaml.safe_load(RULES.read_text())
    assert isinstance(loaded, dict)
    return loaded


def panels(board: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too; rows themselves are not panels."""
    for panel in board.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def panel_queries(board: Mapping[str, Any]) -> list[Query]:
    return [
        Query(f"panel {panel['title']!r} {target['refId']}", target["expr"])
        for panel in panels(board)
        for target in panel.get("targets", [])
    ]


def variables(board: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(board.get("templating", {}).get("list", []))


def label_values_query(variable: Mapping[str, Any]) -> tuple[str, str] | None:
    """A query variable's ``label_values(selector, label)``, as (selector, label)."""
    query = variable.get("query")
    if isinstance(query, dict):
        query = query.get("query")
    match = re.fullmatch(r"\s*label_values\((.+),\s*(\w+)\)\s*", str(query or ""))
    return (match.group(1), match.group(2)) if match else None


def rule_queries(groups: Mapping[str, Any]) -> list[Query]:
    return [
        Query(f"alert {rule.get('alert') or rule.get('record')}", rule["expr"])
        for group in groups["groups"]
        for rule in group["rules"]
    ]


def with_bool(expr: str) -> str:
    """``expr`` with ``bool`` on each comparison against a number, so that an alert's
    expression returns its series (as 0 or 1) when it would not fire as well."""
    return _COMPARISON.sub(r"\1 bool\2", expr)


def metric_names(expr: str) -> set[str]:
    """The server's metric names ``expr`` reads (``microbatch_*``, ``process_*``)."""
    return set(_METRIC.findall(expr))


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """Grafana's ``$name`` and ``${name}`` replaced by ``values[name]``; fails on one that
    has no value (a panel would show an error)."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in values, f"no value for ${name} in {expr}"
        return values[name]

    return _VARIABLE.sub(value, expr)


def regex_escaped(value: str) -> str:
    """A label value as Grafana puts it into a query for a multi-value variable (its
    Prometheus data source's ``prometheusSpecialRegexEscape``): regex metacharacters get
    two backslashes in the PromQL string, one in the regex."""
    value = value.replace("\\", "\\\\\\\\")
    return re.sub(r"[$^*{}\[\]'+?.()|]", lambda match: "\\\\" + match.group(0), value)


class PrometheusError(AssertionError):
    """Prometheus answered a query with an error."""


class PrometheusServer(ChildProcess):
    """``with PrometheusServer(targets) as prometheus:`` a real Prometheus on 127.0.0.1 at a
    free port, scraping ``targets`` (host:port) every SCRAPE_S, with ``rule_files`` loaded
    and evaluated as often, its data in a scratch folder removed at the end."""

    name = "prometheus"

    def __init__(self, targets: Sequence[str], rule_files: Sequence[Path] = ()) -> None:
        self.binary = require_tool("prometheus")
        self.targets = list(targets)
        self.rule_files = [str(path) for path in rule_files]
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.dir = Path(tempfile.mkdtemp(prefix="mbtest-prometheus-"))
        self.process: subprocess.Popen[str] | None = None
        self.output = ""

    def start(self, timeout_s: float = 30) -> PrometheusServer:
        config = {
            "global": {
                "scrape_interval": f"{SCRAPE_S}s",
                "scrape_timeout": f"{SCRAPE_S}s",
                "evaluation_interval": f"{SCRAPE_S}s",
            },
            "rule_files": self.rule_files,
            "scrape_configs": [
                {"job_name": "microbatch", "static_configs": [{"targets": self.targets}]}
            ],
        }
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.process = start(
            [
                self.binary,
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                self.output = self.process.communicate()[0]
                raise AssertionError(f"prometheus exited during start:\n{self.output}")
            try:
                if httpx.get(f"{self.base_url}/-/ready", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("prometheus never became ready")
            time.sleep(0.1)

    def api(self, path: str, **params: Any) -> Any:
        """``GET /api/v1/<path>``'s data; raises PrometheusError on an error answer."""
        answer = httpx.get(f"{self.base_url}/api/v1/{path}", params=params, timeout=30).json()
        if answer.get("status") != "success":
            raise PrometheusError(f"{answer.get('errorType')}: {answer.get('error')}")
        return answer["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's series (``[{"metric": {...}, "value": [t, "v"]}, ...]``)."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        data = self.api("query", **params)
        assert data["resultType"] == "vector", f"{expr}: a {data['resultType']}, not a vector"
        return list(data["result"])

    def label_values(self, selector: str, label: str) -> list[str]:
        """What Grafana's ``label_values(selector, label)`` lists."""
        found = self.api("series", **{"match[]": selector})
        return sorted({series[label] for series in found if label in series})

    def scraped_after(self, moment: float, timeout_s: float = 30) -> None:
        """Wait until the server has been scraped after ``moment`` (a Unix time)."""
        deadline = time.monotonic() + timeout_s
        while True:
            latest = self.query("max(timestamp(microbatch_queue_depth))")
            if latest and float(latest[0]["value"][1]) > moment:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"no scrape after {moment}: {latest}")
            time.sleep(0.2)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        try:
            super().__exit__(*exc_info)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
