"""Imports point one way, as the README's architecture says; this test is what makes it true.

routers -> (v2, the Open Inference Protocol both edges share) -> services -> batching <- workers,
broker (they fill its Transport); app.main starts v2's gRPC edge
plan, settings, errors, jobs, manifest, repository, lifecycle, images, logs, answers, jsonbody:
leaves
that any layer may import (batching only the vocabulary of lifecycle, for the seam's types, and
background, which holds its running batches)
tracing: the spans workers, broker, v2 and routers make (batching carries a trace unopened)
tenancy and cache: what services ask before the Streamer (keys and quotas; kept answers),
each with its Redis side on the broker's wire
engine and main wire the layers together; nothing below them imports them
broker's rooms: front -> wire <- worker (a front end and a worker share only the wire)
and no two modules import each other, in any form or round any circle
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parents[2] / "app"
MODULES = {  # dotted name -> file
    ".".join(path.relative_to(APP.parent).with_suffix("").parts).removesuffix(".__init__"): path
    for path in APP.rglob("*.py")
}
LEAVES = {
    "plan", "settings", "settings_values", "settings_testing", "settings_broker", "errors",
    "jobs", "manifest",
    "repository",
    "lifecycle", "images", "logs", "answers", "jsonbody", "background",
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
        ("batching", {"errors", "lifecycle", "background"}),
        ("lifecycle", {"errors"}),
        ("settings", {"errors", "settings_values", "settings_testing", "settings_broker"}),
        ("settings_testing", set()),
        ("settings_broker", {"settings_values"}),
        ("settings_values", set()),
        ("errors", set()),
        ("tracing", {"errors"}),
        ("plan", {"settings", "settings_values", "errors"}),
        ("tenancy", {"broker"} | BELOW),
        ("cache", {"broker"} | BELOW),
        ("services", {"tenancy", "cache"} | BELOW),
        ("workers", {"metrics", "tracing"} | BELOW),
        ("broker", {"workers", "metrics", "tracing"} | BELOW),
        ("v2", {"services", "tenancy", "cache", "tracing"} | BELOW),
        (
            "routers",
            {"services", "dependencies", "schemas", "metrics", "v2", "tracing", "tenancy", "cache"}
            | BELOW,
        ),
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


def module_imports(path: Path) -> set[str]:
    """The ``app`` modules a file imports, in any form: at the top, in a function or under
    ``if TYPE_CHECKING:``; ``from app.x import y`` is ``app.x.y`` where that is a module,
    else ``app.x``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: a relative import (this scan reads absolute ones)"
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in MODULES else node.module)
    return {name for name in found if name in MODULES}


def find_circle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """A circle of imports in ``graph`` (module -> the modules it imports), as the modules
    round it with the first one again at the end; None when there is none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        path.append(module)
        for imported in sorted(graph.get(module, set())):
            if imported in path:
                return [*path[path.index(imported) :], imported]
            if imported not in done and (circle := visit(imported)):
                return circle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done and (circle := visit(module)):
            return circle
    return None


def test_no_module_imports_another_that_imports_it() -> None:
    """No import circle among app's modules, of any length, counting imports in functions
    and under ``if TYPE_CHECKING:`` (a circle hidden there is a circle still: neither module
    can be read, or changed, without the other). Where one module needs another's type,
    it names what it uses as a ``Protocol``."""
    graph = {name: module_imports(path) - {name} for name, path in MODULES.items()}
    circle = find_circle(graph)
    assert circle is None, " -> ".join(circle or [])


def test_the_circle_check_sees_a_circle_by_annotations(tmp_path: Path) -> None:
    """What the check above would have caught: ``app.workers.supervision`` typed its pool by
    importing ``WorkerPool`` under ``TYPE_CHECKING`` from the pool, which imports it."""
    source = tmp_path / "module.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from app.workers import backoff\n"
        "if TYPE_CHECKING:\n"
        "    from app.workers.pool import WorkerPool\n"
    )
    assert module_imports(source) == {"app.workers.backoff", "app.workers.pool"}
    graph = {"pool": {"supervision", "handle"}, "supervision": {"pool"}, "handle": set()}
    assert find_circle(graph) == ["pool", "supervision", "pool"]
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize(
    ("room", "allowed"),
    [("wire", set()), ("front", {"wire"}), ("worker", {"wire"}), ("cluster", set())],
)
def test_each_broker_room_imports_only_the_wire(room: str, allowed: set[str]) -> None:
    """A front end and a worker share only what crosses between them (``app.broker.wire``);
    neither imports the other's side, not even for a type."""
    root = APP / "broker" / room
    files = sorted(root.rglob("*.py")) if root.is_dir() else [APP / "broker" / f"{room}.py"]
    rooms = {
        module.split(".")[2]
        for path in files
        for module in module_imports(path)
        if module.startswith("app.broker.")
    }
    assert rooms - {room} <= allowed, rooms - {room} - allowed


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
