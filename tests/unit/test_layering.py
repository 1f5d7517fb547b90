"""Imports point one way: the batching core must not pull in the web framework or torch."""

from __future__ import annotations

import subprocess
import sys


def _modules_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_batching_imports_neither_fastapi_nor_torch() -> None:
    loaded = _modules_after_import("app.batching")
    assert "fastapi" not in loaded
    assert "torch" not in loaded
    assert "numpy" not in loaded


def test_services_do_not_import_torch() -> None:
    loaded = _modules_after_import("app.services.predictor")
    assert "torch" not in loaded


def test_workers_import_neither_services_nor_the_web_framework() -> None:
    loaded = _modules_after_import("app.workers.pool")
    assert not {m for m in loaded if m.startswith(("app.services", "app.routers"))}
    assert "fastapi" not in loaded


def test_torchvision_is_imported_only_to_decode_on_a_device() -> None:
    # Importing torchvision takes about 2 s, in the HTTP process and in every worker.
    assert "torchvision" not in _modules_after_import("app.workers.pool")
