"""``app.workers.process.PreparedWorker``: several models in one worker, each loaded beside
the others, measured, bounded by MB_MODEL_MEMORY, and unloaded with its memory given back."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from app.jobs import Task
from app.lifecycle import ModelSpec
from app.manifest import read_manifest
from app.plan import WorkerConfig
from app.workers.allocator import anonymous_bytes
from app.workers.process import LoadFailure, PreparedWorker
from tests.models import HeavyEmbedding, export_scaled, export_test_model, export_tiny

pytestmark = pytest.mark.slow

MB = 1 << 20


def spec(store: Path, name: str = "tiny", version: int = 1) -> ModelSpec:
    manifest = read_manifest(store)
    return ModelSpec(name, version, str(store), manifest.model_id, manifest.input.image_shape)


def test_one_worker_holds_two_versions_and_runs_each_on_its_own(tmp_path: Path) -> None:
    one, two = export_tiny(tmp_path / "1"), export_scaled(tmp_path / "2", 3.0)
    worker = PreparedWorker(WorkerConfig(max_batch_size=4), "cpu", 1)
    first, second = worker.load(spec(one)), worker.load(spec(two, version=2))
    pixels = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    a = first.runner.run(Task.EMBEDDING, pixels, 0)["embedding"]
    b = second.runner.run(Task.EMBEDDING, pixels, 0)["embedding"]
    np.testing.assert_allclose(b, 3 * a, rtol=1e-5)
    assert set(worker.models) == {spec(one).served_id, spec(two).served_id}
    with pytest.raises(KeyError, match="holds no model"):
        worker.model("other@000000000000")


def test_a_version_whose_folder_changed_is_refused(tmp_path: Path) -> None:
    store = export_tiny(tmp_path / "1")
    stale = spec(store)
    export_scaled(store, 2.0)  # the same folder, another export: versions are immutable
    worker = PreparedWorker(WorkerConfig(max_batch_size=4), "cpu", 1)
    with pytest.raises(LoadFailure, match="must not change once published") as failure:
        worker.load(stale)
    assert failure.value.step == "verify" and worker.models == {}


def test_the_budget_refuses_before_loading_and_names_both_figures(tmp_path: Path) -> None:
    small = export_tiny(tmp_path / "small")
    heavy = export_test_model(tmp_path / "heavy", HeavyEmbedding(48))
    worker = PreparedWorker(WorkerConfig(max_batch_size=4, memory_budget_bytes=32 * MB), "cpu", 1)
    worker.load(spec(small))
    held = worker.held_bytes
    with pytest.raises(LoadFailure) as failure:
        worker.load(spec(heavy, "heavy"))
    assert failure.value.step == "budget"
    said = str(failure.value)
    assert re.search(r"it needs 48\.\dMiB \(its model files\) and the models loaded hold ", said)
    assert f"hold {held / MB:.1f}MiB" in said or f"hold {held // MB}MiB" in said
    assert "over MB_MODEL_MEMORY=32MiB" in said  # quoted as it was set
    assert set(worker.models) == {spec(small).served_id}
    # Set in decimal megabytes, it is quoted so (it was "648 MB" for MB_MODEL_MEMORY=680MB).
    decimal = PreparedWorker(WorkerConfig(max_batch_size=4, memory_budget_bytes=680 * 10**6),
                             "cpu", 1)  # fmt: skip
    with pytest.raises(LoadFailure, match=r"over MB_MODEL_MEMORY=680MB"):
        decimal._check_budget(spec(heavy, "heavy"), 700 * 10**6, "measured once loaded")


def test_an_unloaded_model_gives_its_memory_back(tmp_path: Path) -> None:
    """Two 96 MB models in turn: the worker's anonymous memory after an unload is back
    within a few MB of where it was before the load."""
    first = export_test_model(tmp_path / "a", HeavyEmbedding(96))
    second = export_test_model(tmp_path / "b", HeavyEmbedding(96), arch="heavy-b")
    worker = PreparedWorker(WorkerConfig(max_batch_size=4), "cpu", 1)
    worker.load(spec(first, "a"))
    before = anonymous_bytes()
    loaded = worker.load(spec(second, "b"))
    assert loaded.memory_bytes >= 96 * MB  # at least its files
    assert anonymous_bytes() - before >= 90 * MB
    del loaded
    worker.unload(spec(second).served_id)
    assert anonymous_bytes() - before < 16 * MB
