"""The locust load test runs headless against a real server with zero failures."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from tests.children import dies_with_run
from tests.server import REPO, ServerProcess

pytestmark = pytest.mark.slow


def test_locust_runs_headless_with_zero_failures(tiny_store: Path, tmp_path: Path) -> None:
    with ServerProcess(MODEL_STORE=str(tiny_store)) as server:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "locust",
                "-f",
                "tests/load/locustfile.py",
                "--host",
                server.base_url,
                "--headless",
                "-u",
                "8",
                "-r",
                "8",
                "-t",
                "4s",
                "--only-summary",
                "--exit-code-on-error",
                "1",
                "--csv",
                str(tmp_path / "run"),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=90,
            preexec_fn=dies_with_run(),
        )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    with (tmp_path / "run_stats.csv").open() as handle:
        rows = {row["Name"]: row for row in csv.DictReader(handle)}
    assert int(rows["Aggregated"]["Request Count"]) > 20
    assert int(rows["Aggregated"]["Failure Count"]) == 0
    assert (
        int(rows["/predict/tag"]["Request Count"])
        > int(rows["/predict/embedding"]["Request Count"])
        > 0
    )
