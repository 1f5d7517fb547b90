"""AOTInductor packages (``--runtimes aoti``): compiled from the export's programs for this
CPU, keyed by what they were built for, refused on a host that does not match, served like
any other runtime."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from app.errors import ModelStoreError, WorkerStartError
from app.exporters import aoti
from app.jobs import Task
from app.manifest import read_manifest
from app.workers.models import LOADERS, LoadOptions, host_mismatch, load_models
from app.workers.runner import BatchRunner
from app.workers.runtimes import choose_runtime, self_test_images
from tests.conftest import assert_cat_then_espresso, photo_pixels, served_with_runtime
from tests.models import export_tiny

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(aoti.compiler() is None, reason="AOTInductor needs a C++ compiler"),
]

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def aoti_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_tiny(tmp_path_factory.mktemp("aoti"), runtimes=("openvino", "aoti"))


def _copy(store: Path, to: Path) -> Path:
    shutil.copytree(store, to, dirs_exist_ok=True)
    return to


def _rekey(store: Path, **built_for: str) -> None:
    path = store / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["runtimes"]["aoti"]["built_for"] |= built_for
    path.write_text(json.dumps(manifest))


def test_the_export_compiles_packages_keyed_by_the_host(aoti_store: Path) -> None:
    artifact = read_manifest(aoti_store).runtimes["aoti"]
    assert set(artifact.files) == {"embedding", "classifier"}
    assert artifact.source == "program" and artifact.max_abs_diff < 1e-3
    assert artifact.built_for["isa"] == aoti.host_isa()
    assert artifact.built_for["threads"] == "dynamic"
    assert artifact.versions["torch"] == torch.__version__
    assert host_mismatch(artifact.built_for) is None


def test_a_package_agrees_with_torchscript_at_any_batch(aoti_store: Path) -> None:
    pixels = self_test_images(read_manifest(aoti_store).input.image_shape, 3)
    reference = BatchRunner(load_models(aoti_store, CPU), CPU)
    package = BatchRunner(load_models(aoti_store, CPU, LoadOptions(), "aoti"), CPU)
    for count in (1, 3):
        expected = reference.run(Task.EMBEDDING, pixels[:count], 0)["embedding"]
        got = package.run(Task.EMBEDDING, pixels[:count], 0)["embedding"]
        np.testing.assert_allclose(got, expected, atol=1e-5)
    tags, got_tags = (r.run(Task.TAG, pixels, 5) for r in (reference, package))
    assert (tags["indices"] == got_tags["indices"]).all()


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ({"isa": "avx512 avx512_vnni amx_tile sve256"}, "which this CPU lacks"),
        ({"machine": "aarch64"}, "built for aarch64"),
        ({"threads": "4"}, "built for 4 threads"),
    ],
)
def test_a_package_built_for_another_host_is_refused_not_run(
    aoti_store: Path,
    tmp_path: Path,
    key: dict[str, str],
    why: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = _copy(aoti_store, tmp_path / "store")
    _rekey(store, **key)
    ran: list[object] = []

    def load_package(*args: object, **kwargs: object) -> object:
        ran.append(args)
        return lambda x: x

    monkeypatch.setattr("torch._inductor.aoti_load_package", load_package)
    with pytest.raises(ModelStoreError, match=f"not built for this host .*{why}"):
        load_models(store, CPU, LoadOptions(), "aoti")
    with pytest.raises(WorkerStartError, match=why):
        choose_runtime(store, CPU, LoadOptions(threads=1), "aoti")
    with caplog.at_level(logging.WARNING, logger="app.worker"):
        choice = choose_runtime(store, CPU, LoadOptions(threads=1), "auto")
    assert choice.models.runtime != "aoti" and why in choice.skipped["aoti"]
    assert ran == []  # never loaded, let alone run


def test_a_gpu_worker_refuses_the_cpu_packages(aoti_store: Path) -> None:
    """Up to the device boundary (no GPU here): the packages are compiled for the CPU."""
    path = aoti_store / read_manifest(aoti_store).runtimes["aoti"].files["embedding"].path
    with pytest.raises(ValueError, match="compiled for the CPU, not cuda:0"):
        LOADERS["aoti"](path, torch.device("cuda", 0), LoadOptions())


def test_without_a_compiler_the_export_says_so_and_still_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(aoti, "compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger="app.export"):
        export_tiny(tmp_path, runtimes=("aoti",))
    assert "no C++ compiler" in caplog.text
    assert "aoti" not in read_manifest(tmp_path).runtimes
    assert not (tmp_path / "aoti").exists()


def test_bf16_and_int8_leave_the_fp32_packages_out(aoti_store: Path) -> None:
    with pytest.raises(ModelStoreError, match="float32 only"):
        load_models(aoti_store, CPU, LoadOptions(dtype=torch.bfloat16), "aoti")
    choice = choose_runtime(aoti_store, CPU, LoadOptions(dtype=torch.bfloat16, threads=1), "auto")
    assert choice.models.runtime != "aoti" and "aoti" not in choice.images_per_s


async def test_the_app_serves_with_aoti_and_says_so(aoti_store: Path) -> None:
    runtimes, _ = await served_with_runtime(aoti_store, "aoti")
    assert runtimes == ["aoti"]


def test_the_real_model_compiled_tags_the_photos_like_torchscript(
    tmp_path: Path, cat_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    from app.export import export

    export("efficientnet_lite0", "pretrained", tmp_path, runtimes=("aoti",))
    pixels = photo_pixels(tmp_path, cat_jpeg, coffee_jpeg)
    reference = BatchRunner(load_models(tmp_path, CPU), CPU)
    package = BatchRunner(load_models(tmp_path, CPU, LoadOptions(), "aoti"), CPU)
    tags, got = (runner.run(Task.TAG, pixels, 5) for runner in (reference, package))
    assert (tags["indices"] == got["indices"]).all()
    assert_cat_then_espresso(tmp_path, got["indices"])
