"""The export's runtime-neutral record: ``torch.export`` programs (``.pt2``) with a dynamic
batch beside the TorchScript files, vouched for by the manifest, and optional."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from app.errors import ModelStoreError
from app.manifest import read_manifest
from app.workers.models import load_models
from tests.models import PoisonEmbedding, export_poison, export_test_model, export_tiny


def test_the_export_writes_programs_that_agree_with_torchscript_at_any_batch(
    tmp_path: Path,
) -> None:
    store = export_tiny(tmp_path / "store")
    manifest = read_manifest(store)
    program = manifest.program
    assert program is not None and set(program.files) == {"embedding", "classifier"}
    assert program.versions["torch"] == torch.__version__ and program.max_abs_diff < 1e-4
    scripted = load_models(store, torch.device("cpu"))
    embedding = torch.export.load(str(store / program.files["embedding"].path)).module()
    classifier = torch.export.load(str(store / program.files["classifier"].path)).module()
    with torch.no_grad():
        for size in (1, 2, 5):  # exported on 2: 1 must not have been fixed, nor 2
            x = torch.rand(size, 3, 32, 32).contiguous(memory_format=torch.channels_last)
            features = scripted.embedding(x)
            torch.testing.assert_close(embedding(x), features, atol=1e-5, rtol=1e-5)
            assert scripted.classifier is not None
            torch.testing.assert_close(
                classifier(features), scripted.classifier(features), atol=1e-5, rtol=1e-5
            )
    # A changed program is refused like a changed TorchScript file.
    path = store / program.files["embedding"].path
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(ModelStoreError, match=r"program embedding file .* does not match"):
        read_manifest(store)


def test_a_model_torch_export_cannot_capture_still_exports_without_programs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="app.export"):
        store = export_poison(tmp_path / "store")  # scripted: torch.export cannot read it
    assert read_manifest(store).program is None
    assert not list(store.glob("*.pt2"))
    assert "no torch.export program for this export" in caplog.text


def test_without_programs_the_openvino_ir_comes_from_the_traces(tmp_path: Path) -> None:
    store = export_test_model(
        tmp_path / "store", torch.jit.script(PoisonEmbedding()), runtimes=("openvino",)
    )
    manifest = read_manifest(store)
    assert manifest.program is None
    assert manifest.runtimes["openvino"].source == "torchscript"


def test_a_store_from_before_programs_still_loads(tmp_path: Path) -> None:
    store = export_tiny(tmp_path / "store")
    manifest = json.loads((store / "manifest.json").read_text())
    del manifest["program"]
    (store / "manifest.json").write_text(json.dumps(manifest))
    for file in store.glob("*.pt2"):
        file.unlink()
    assert read_manifest(store).program is None
    assert load_models(store, torch.device("cpu")).classifier is not None
