"""What users install is what the package imports: every third-party module imported anywhere
under ``app/`` (at the top of a module or inside a function) is declared, pinned, in
``requirements.txt``, the only file the Docker image and ``make install`` read. A module that
only arrives through another package, or through the dev requirements, fails here."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PINNED = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==\S+$")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements() -> dict[str, str]:
    """requirements.txt as {normalised name: line}; any line that is not `name==version` fails."""
    declared = {}
    for raw in (REPO / "requirements.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = PINNED.match(line)
        assert match, f"requirements.txt: {raw!r} is not pinned as name==version"
        declared[_normalise(match.group(1))] = line
    return declared


def imported_modules(package: Path) -> dict[str, str]:
    """The top-level modules imported by the files under ``package``: {module: first file}."""
    found: dict[str, str] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(
                    name.split(".")[0],
                    path.name if package != REPO / "app" else str(path.relative_to(REPO)),
                )
    return found


def test_imported_modules_finds_function_level_imports(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("import os\ndef f():\n    from yaml import safe_load\n")
    assert set(imported_modules(tmp_path)) == {"os", "yaml"}


def test_every_third_party_import_under_app_is_declared() -> None:
    declared = _requirements()
    distributions = packages_distributions()
    undeclared = []
    for module, where in imported_modules(REPO / "app").items():
        if module in sys.stdlib_module_names or module in {"app", "__future__"}:
            continue
        owners = {_normalise(name) for name in distributions.get(module, [])}
        assert owners, f"{where} imports {module}, which no installed distribution provides"
        if not owners & declared.keys():
            undeclared.append(f"{module} ({where}; from {', '.join(sorted(owners))})")
    assert undeclared == [], "declare these in requirements.txt: " + "; ".join(undeclared)


def test_runtime_requirements_are_pinned_like_the_constraints() -> None:
    constraints = {
        _normalise(line.split("==")[0]): line.split("==")[1]
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    for name, line in _requirements().items():
        assert constraints.get(name) == line.split("==")[1], f"{line} differs from constraints.txt"
