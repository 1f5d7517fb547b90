"""Exporting and serving below fp32: ``--precision int8 --calibrate DIR`` (OpenVINO + nncf,
gated on held-back images) and ``--precision bf16``; MB_DTYPE=auto serves what the store was
exported for, and says so in X-Model-Id."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from app.errors import WorkerStartError
from app.export import ExportError, PrecisionRequest, main
from app.exporters.precision import GOLDEN_FILE, GOLDEN_IMAGES
from app.jobs import Task
from app.manifest import Gate, read_manifest
from app.workers import agreement as agreement_module
from app.workers.models import LoadOptions, load_models
from app.workers.runner import BatchRunner
from app.workers.runtimes import choose_runtime
from bench.systems import photo_views
from tests.conftest import (
    assert_cat_then_espresso,
    distinct_images,
    embed,
    photo_pixels,
    running_app,
)
from tests.models import ConvEmbedding, export_test_model

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
LENIENT = Gate(top1=0.0, cosine_mean=0.0)
IMPOSSIBLE = Gate(top1=1.0, cosine_mean=1.0)


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return photo_views(tmp_path_factory.mktemp("photos"), 100)


def _int8(out: Path, photos: Path, gate: Gate = LENIENT, accept: bool = False) -> Path:
    torch.manual_seed(0)
    request = PrecisionRequest("int8", photos, accept_accuracy_loss=accept, gate=gate)
    return export_test_model(
        out, ConvEmbedding(), arch="conv-test", runtimes=("openvino",), precision=request
    )


@pytest.fixture(scope="module")
def int8_store(tmp_path_factory: pytest.TempPathFactory, photos: Path) -> Path:
    return _int8(tmp_path_factory.mktemp("int8"), photos)


def test_an_int8_export_carries_its_models_and_measured_agreement(int8_store: Path) -> None:
    manifest = read_manifest(int8_store)  # verifies every file, the int8 and golden ones too
    assert manifest.precision == "int8"
    assert set(manifest.int8_files) == {"embedding"}
    assert "embedding+int8.bin" in manifest.runtimes["openvino"].files
    calibration = manifest.calibration
    assert calibration is not None and calibration.passed
    # 100 images: every 5th held back to measure on, the other 80 calibrated with.
    assert calibration.calibration_images == 80 and calibration.held_back.images == 20
    held = calibration.held_back
    assert held.top1 is not None and held.top5 is not None
    assert 0.0 <= held.top1 <= 1.0 and held.cosine_min <= held.cosine_mean <= 1.0 + 1e-6
    assert held.cosine_mean > 0.9  # a convolution and pooling quantize well
    assert "nncf" in calibration.method
    golden = np.load(int8_store / GOLDEN_FILE)
    assert golden.shape == (GOLDEN_IMAGES, 32, 32, 3) and golden.dtype == np.uint8
    assert calibration.golden_agreement.images == GOLDEN_IMAGES


def test_int8_serves_by_default_close_to_fp32_and_says_so(int8_store: Path) -> None:
    manifest = read_manifest(int8_store)
    assert manifest.serving_dtype("auto") == "int8"
    assert manifest.served_id("auto") == f"{manifest.model_id}+int8"
    assert manifest.served_id("float32") == manifest.model_id
    choice = choose_runtime(int8_store, CPU, LoadOptions(dtype=torch.int8, threads=1), "auto")
    assert choice.models.runtime == "openvino"
    pixels = np.load(int8_store / GOLDEN_FILE)
    fp32 = BatchRunner(load_models(int8_store, CPU), CPU).run(Task.EMBEDDING, pixels, 0)
    int8 = BatchRunner(choice.models, CPU).run(Task.EMBEDDING, pixels, 0)
    cosine = torch.nn.functional.cosine_similarity(
        torch.from_numpy(fp32["embedding"]), torch.from_numpy(int8["embedding"])
    )
    assert float(cosine.min()) > 0.9
    assert not np.array_equal(fp32["embedding"], int8["embedding"])  # it is not fp32
    # The same store still serves fp32 when asked, with any runtime.
    fp32_choice = choose_runtime(int8_store, CPU, LoadOptions(threads=1), "torchscript")
    assert fp32_choice.models.runtime == "torchscript"
    with pytest.raises(WorkerStartError, match="cannot serve int8"):
        choose_runtime(int8_store, CPU, LoadOptions(dtype=torch.int8, threads=1), "torchscript")


def test_int8_tries_its_float_layers_in_bf16_where_the_cpu_has_bf16_units(
    int8_store: Path,
) -> None:
    options = LoadOptions(dtype=torch.int8, threads=1)
    choice = choose_runtime(int8_store, CPU, options, "auto", dtypes=[torch.int8], bf16_units=True)
    assert set(choice.trials) == {"openvino", "openvino+bf16"}
    for trial in choice.trials.values():  # each gated, on the export's golden images
        assert trial.cosine_min is not None and trial.cosine_min > 0.9
    assert choice.dtype == torch.int8 and choice.models.runtime == "openvino"
    plain = choose_runtime(int8_store, CPU, options, "auto", dtypes=[torch.int8], bf16_units=False)
    assert set(plain.trials) == {"openvino"}


def test_int8_that_fails_its_self_test_on_a_host_stops_the_start(
    int8_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = agreement_module.measure

    def worse(*args: object) -> object:
        measured = real(*args)  # type: ignore[arg-type]
        return measured.model_copy(update={"cosine_mean": measured.cosine_mean - 0.2})

    monkeypatch.setattr("app.workers.runtimes.measure", worse)
    with pytest.raises(WorkerStartError, match=r"failed its self-test here: mean embedding cosine"):
        choose_runtime(int8_store, CPU, LoadOptions(dtype=torch.int8, threads=1), "auto")


def test_too_few_calibration_images_is_a_clear_error_before_anything_is_written(
    tmp_path: Path,
) -> None:
    few = photo_views(tmp_path / "few", 30)
    (few / "notes.txt").write_text("not an image")
    (few / "broken.jpg").write_bytes(b"not a jpeg")
    out = tmp_path / "store"
    with pytest.raises(ExportError, match=r"has 30 readable images; .* needs at least 100"):
        _int8(out, few)
    assert not out.exists()
    with pytest.raises(ExportError, match="needs --calibrate DIR"):
        PrecisionRequest("int8")
    assert main(["--precision", "int8", "--out", str(out)]) == 2


def test_an_int8_export_below_its_gate_is_refused_and_the_store_stays_fp32(
    tmp_path: Path, photos: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ExportError, match=r"int8 refused: .*held-back images\. The store stays"):
        _int8(tmp_path, photos, gate=IMPOSSIBLE)
    manifest = read_manifest(tmp_path)
    assert manifest.precision == "fp32" and manifest.calibration is None
    assert not manifest.int8_files and not (tmp_path / GOLDEN_FILE).exists()
    assert not list((tmp_path / "openvino").glob("*int8*"))
    # Accepted anyway: written, and the manifest says it did not pass.
    _int8(tmp_path, photos, gate=IMPOSSIBLE, accept=True)
    accepted = read_manifest(tmp_path)
    assert accepted.precision == "int8"
    assert accepted.calibration is not None and not accepted.calibration.passed


def test_a_bf16_export_measures_on_the_images_and_serves_bf16_by_default(
    tmp_path: Path, photos: Path
) -> None:
    request = PrecisionRequest("bf16", photos, gate=LENIENT)
    export_test_model(tmp_path, ConvEmbedding(), runtimes=("openvino",), precision=request)
    manifest = read_manifest(tmp_path)
    assert manifest.precision == "bf16" and manifest.serving_dtype("auto") == "bfloat16"
    assert manifest.calibration is not None
    assert manifest.calibration.calibration_images == 0  # nothing to calibrate in bf16
    assert manifest.calibration.held_back.images == 100
    assert manifest.served_id("auto").endswith("+bf16")
    choice = choose_runtime(tmp_path, CPU, LoadOptions(dtype=torch.bfloat16, threads=1), "auto")
    assert choice.models.runtime in ("openvino", "torchscript") and not choice.skipped


def test_a_store_from_before_precisions_serves_fp32(int8_store: Path, tmp_path: Path) -> None:
    manifest = json.loads((int8_store / "manifest.json").read_text())
    for key in ("precision", "calibration"):
        manifest.pop(key)
    files = manifest["runtimes"]["openvino"]["files"]
    for role in [role for role in files if "+int8" in role]:
        files.pop(role)
    for file in int8_store.rglob("*"):
        if file.is_file() and file.name != "manifest.json":
            target = tmp_path / file.relative_to(int8_store)
            target.parent.mkdir(exist_ok=True)
            target.write_bytes(file.read_bytes())
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    old = read_manifest(tmp_path)
    assert old.precision == "fp32" and old.served_id("auto") == old.model_id
    with pytest.raises(WorkerStartError, match="holds no int8 models"):
        choose_runtime(tmp_path, CPU, LoadOptions(dtype=torch.int8, threads=1), "auto")


async def test_the_app_serves_the_int8_store_and_says_so(int8_store: Path) -> None:
    async with running_app(
        model_store=int8_store, cuda_devices="cpu", mb_worker_num=1, mb_dtype="auto"
    ) as (
        _,
        client,
    ):
        image = distinct_images(1)[0]
        response = await client.post("/predict/embedding", files={"file": ("a.png", image)})
        info = (await client.get("/info")).json()
        assert len(await embed(client, image)) == 48
    manifest = read_manifest(int8_store)
    assert response.headers["x-model-id"] == f"{manifest.model_id}+int8"
    assert info["model_id"] == f"{manifest.model_id}+int8"
    assert info["batching"]["dtype"] == "int8"
    assert [worker["runtime"] for worker in info["workers"]] == ["openvino"]


def test_the_real_model_in_int8_still_tags_the_cat(
    tmp_path_factory: pytest.TempPathFactory, cat_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    from app.export import export

    photos = photo_views(tmp_path_factory.mktemp("real_photos"), 120)
    out = tmp_path_factory.mktemp("real_int8")
    request = PrecisionRequest("int8", photos, accept_accuracy_loss=True)
    manifest = export("efficientnet_lite0", "pretrained", out, precision=request)
    assert manifest.calibration is not None
    assert manifest.calibration.held_back.cosine_mean > 0.9
    choice = choose_runtime(out, CPU, LoadOptions(dtype=torch.int8, threads=2), "auto")
    pixels = photo_pixels(out, cat_jpeg, coffee_jpeg)
    tags = BatchRunner(choice.models, CPU).run(Task.TAG, pixels, 5)
    assert_cat_then_espresso(out, tags["indices"])


def test_an_int8_export_has_an_id_of_its_own(int8_store: Path, tmp_path: Path) -> None:
    """Its int8 models (graph and weights) are in its identity: its id is not that of the
    fp32 export of the same weights (which it used to share, so a rollout to it served the
    fp32 model), and another quantization of it (other int8 weights) has another id."""
    torch.manual_seed(0)
    fp32 = export_test_model(tmp_path / "fp32", ConvEmbedding(), "conv-test", ("openvino",))
    int8 = read_manifest(int8_store)
    source = read_manifest(fp32)
    assert int8.content == source.content  # the same weights, the same TorchScript modules
    assert int8.model_id != source.model_id
    assert int8.served_id("auto") == f"{int8.model_id}+int8"
    openvino = int8.runtimes["openvino"]
    for role in ("embedding+int8", "embedding+int8.bin"):
        other = openvino.files | {
            role: openvino.files[role].model_copy(update={"sha256": "0" * 64})
        }
        requantized = int8.model_copy(
            update={"runtimes": {"openvino": openvino.model_copy(update={"files": other})}}
        )
        assert requantized.model_id not in (int8.model_id, source.model_id), role
