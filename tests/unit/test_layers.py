"""Imports point one way, as the README's architecture says; this test is what makes it true.

routers -> (v2, the Open Inference Protocol both edges share) -> services -> batching <- workers,
broker (they fill its Transport); app.main starts v2's gRPC edge
plan, settings, errors, jobs, manifest, repository, lifecycle, images, logs: leaves that any
layer may import (batching only the vocabulary of lifecycle, for the seam's types)
tracing: the spans workers, broker, v2 and routers make (batching carries a trace unopened)
engine and main wire the layers together; nothing below them imports them
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parents[2] / "app"
LEAVES = {
    "plan", "settings", "settings_values", "errors", "jobs", "manifest", "repository",
    "lifecycle", "images", "logs",
}  # fmt: skip
BELOW = {"batching", *LEAVES}  # what every layer above batching may import


def app_imports(path: Path) -> set[str]:
    """The top-level ``app`` modules or packages a file imports (``app.x.y`` counts as ``x``,
    and so does ``from app import x``), except under ``if TYPE_CHECKING:`` (annotations
    only)."""
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "app" and node.level == 0:
            names = [f"app.{alias.name}" for alias in node.names]  # from app import tracing
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found |= {n.split(".")[1] for n in names if n.startswith("app.") and n.count(".") >= 1}
    return found


def layer_imports(layer: str) -> set[str]:
    root = APP / layer
    files = sorted(root.rglob("*.py")) if root.is_dir() else [APP / f"{layer}.py"]
    return set().union(*(app_imports(f) for f in files)) - {layer}


@pytest.mark.parametrize(
    ("layer", "allowed"),
    [
        ("batching", {"errors", "lifecycle"}),
        ("lifecycle", {"errors"}),
        ("settings", {"errors", "settings_values"}),
        ("settings_values", set()),
        ("errors", set()),
        ("tracing", {"errors"}),
        ("plan", {"settings", "settings_values", "errors"}),
        ("services", BELOW),
        ("workers", {"metrics", "tracing"} | BELOW),
        ("broker", {"workers", "metrics", "tracing"} | BELOW),
        ("v2", {"services", "auth", "tracing"} | BELOW),
        ("routers", {"services", "dependencies", "schemas", "metrics", "v2", "tracing"} | BELOW),
    ],
)
def test_each_layer_imports_only_what_is_below_it(layer: str, allowed: set[str]) -> None:
    assert layer_imports(layer) <= allowed, layer_imports(layer) - allowed


def test_every_form_of_import_counts(tmp_path: Path) -> None:
    """``from app import tracing`` imports ``tracing`` as surely as ``from app.tracing import
    x`` does (this test once missed that form, and so every layer's use of tracing)."""
    source = tmp_path / "module.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import app.errors\n"
        "from app import tracing, jobs as renamed\n"
        "from app.batching.transport import Transport\n"
        "if TYPE_CHECKING:\n"
        "    from app import engine\n"
    )
    assert app_imports(source) == {"errors", "tracing", "jobs", "batching"}
    assert "tracing" in layer_imports("routers")  # from app import tracing, in several


def test_nothing_below_the_wiring_imports_it() -> None:
    layers = ("batching", "services", "workers", "broker", "plan", "routers", "dependencies")
    for layer in (*layers, "v2", "tracing", *LEAVES):
        assert not layer_imports(layer) & {"engine", "main"}, layer


def test_the_processes_that_run_no_model_import_no_torch() -> None:
    """The HTTP process (app, engine, pool) and the broker workers' supervisor plan and
    supervise without torch: only the worker processes import it (hundreds of MB each)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import app.main, app.engine, app.workers.pool, app.broker.front.transport\n"
        "import app.broker.worker.__main__\n"
        "from app.plan import Role, plan_serving\n"
        "from app.settings import Settings\n"
        "plan_serving(Settings(cuda_devices='cpu'))\n"
        "plan_serving(Settings(mb_broker='redis://h:6379/0'), Role.WORKERS)\n"
        "print(sorted(m for m in ('torch', 'torchvision', 'timm') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
