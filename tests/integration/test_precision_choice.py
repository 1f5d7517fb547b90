"""MB_DTYPE=auto on an fp32 export: each worker tries the precisions its CPU computes natively
(bf16 where it has bf16 units), gates each against fp32 TorchScript (top-1 equal, embedding
cosine at least 0.99), serves the fastest that passes, logs what it measured, and says in
the served id which precision computed the answer."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from app.jobs import Task
from app.lifecycle import ModelSpec
from app.manifest import read_manifest
from app.plan import WorkerConfig
from app.workers import runtimes as runtimes_module
from app.workers.models import LoadedModels, LoadOptions, load_models
from app.workers.process import PreparedWorker
from app.workers.runner import BatchRunner
from app.workers.runtimes import candidate_dtypes, choose_runtime, cpu_has_bf16
from tests.conftest import assert_cat_then_espresso, distinct_images, photo_pixels, running_app
from tests.models import ConvEmbedding, FragileClassifier, TinyEmbedding, export_test_model

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
BOTH = [torch.float32, torch.bfloat16]
needs_bf16 = pytest.mark.skipif(
    not cpu_has_bf16(), reason="OpenVINO computes bf16 only on a CPU with bf16 units"
)


@pytest.fixture(scope="module")
def conv_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("conv")
    return export_test_model(out, ConvEmbedding(), arch="conv-test", runtimes=("openvino",))


@pytest.fixture(scope="module")
def fragile_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fragile")
    return export_test_model(
        out, TinyEmbedding(), "fragile-test", ("openvino",), classifier=FragileClassifier()
    )


def bf16_twice_as_fast(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Time every candidate as if bf16 ran twice as fast as fp32 (real timings of a tiny
    model are noise): what the choice does with the figures, on any CPU. Returns the
    precisions timed, in order."""
    timed: list[str] = []

    def rate(models: LoadedModels, device: torch.device, pixels: object) -> float:
        timed.append(models.precision)
        return 200.0 if models.precision == "bfloat16" else 100.0

    monkeypatch.setattr(runtimes_module, "images_per_s", rate)
    return timed


def auto_spec(store: Path) -> ModelSpec:
    manifest = read_manifest(store)
    return ModelSpec(
        "conv", 1, str(store), manifest.model_id, manifest.input.image_shape, dtype="auto"
    )


def test_the_gate_refuses_a_precision_that_changes_top1(fragile_store: Path) -> None:
    choice = choose_runtime(
        fragile_store, CPU, LoadOptions(threads=1), "torchscript", dtypes=BOTH, bf16_units=True
    )
    trial = choice.trials["torchscript+bf16"]
    assert not trial.passed and trial.top1 is not None and trial.top1 < 1.0
    assert trial.cosine_min is not None and trial.cosine_min > 0.99  # the embedding is fine
    assert choice.skipped["torchscript+bf16"] == "top-1 classes differ from TorchScript's"
    assert choice.dtype == torch.float32 and choice.models.runtime == "torchscript"
    if cpu_has_bf16():  # elsewhere OpenVINO computes its bf16 hint in fp32: nothing to refuse
        choice = choose_runtime(
            fragile_store, CPU, LoadOptions(threads=1), "openvino", dtypes=BOTH, bf16_units=True
        )
        assert not choice.trials["openvino+bf16"].passed
        assert choice.dtype == torch.float32 and choice.models.runtime == "openvino"


def test_auto_serves_the_fastest_precision_that_passes_and_its_id_says_so(
    conv_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    timed = bf16_twice_as_fast(monkeypatch)
    choice = choose_runtime(
        conv_store, CPU, LoadOptions(threads=1), "auto", dtypes=BOTH, bf16_units=True
    )
    assert set(choice.trials) == {"torchscript", "openvino", "torchscript+bf16", "openvino+bf16"}
    assert all(trial.passed for trial in choice.trials.values())
    for label in ("openvino", "torchscript+bf16", "openvino+bf16"):
        cosine = choice.trials[label].cosine_min
        assert cosine is not None and cosine >= 0.99
    assert sorted(timed) == ["bfloat16", "bfloat16", "float32", "float32"]
    assert choice.dtype == torch.bfloat16 and choice.models.precision == "bfloat16"
    # Through a worker: the id says bf16.
    worker = PreparedWorker(WorkerConfig(max_batch_size=4, bf16_units=True), "cpu", 1)
    spec = auto_spec(conv_store)
    prepared = worker.load(spec)
    manifest = read_manifest(conv_store)
    assert prepared.spec.served_id == f"{manifest.model_id}+bf16"
    assert prepared.spec.dtype == "bfloat16" and prepared.report.dtype == "bfloat16"
    assert {trial.label for trial in prepared.trials} == set(choice.trials)
    embedding = prepared.runner.run(Task.EMBEDDING, _pixels(conv_store), 0)["embedding"]
    assert embedding.dtype.name == "float32" and embedding.shape == (2, 48)


def test_float32_insists_on_fp32(conv_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timed = bf16_twice_as_fast(monkeypatch)  # bf16 would win, if it were tried
    manifest = read_manifest(conv_store)
    assert candidate_dtypes(manifest, "float32", CPU, bf16_units=True) == ["float32"]
    worker = PreparedWorker(WorkerConfig(max_batch_size=4, bf16_units=True), "cpu", 1)
    prepared = worker.load(ModelSpec("conv", 1, str(conv_store), manifest.model_id, (32, 32, 3)))
    assert prepared.spec.served_id == manifest.model_id and prepared.spec.dtype == "float32"
    assert not any("bf16" in trial.label for trial in prepared.trials)
    assert "bfloat16" not in timed and prepared.runner.models.precision == "float32"


def test_a_cpu_without_bf16_never_tries_it(
    conv_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[torch.dtype] = []

    def recording(store: Path, device: torch.device, options: LoadOptions, **kw: Any) -> Any:
        asked.append(options.dtype)
        return load_models(store, device, options, **kw)

    monkeypatch.setattr(runtimes_module, "load_models", recording)
    manifest = read_manifest(conv_store)
    assert candidate_dtypes(manifest, "auto", CPU, bf16_units=False) == ["float32"]
    assert candidate_dtypes(manifest, "auto", CPU, bf16_units=True) == ["float32", "bfloat16"]
    worker = PreparedWorker(WorkerConfig(max_batch_size=4, bf16_units=False), "cpu", 1)
    prepared = worker.load(auto_spec(conv_store))
    assert asked and set(asked) == {torch.float32}
    assert prepared.spec.served_id == manifest.model_id and prepared.spec.dtype == "float32"
    assert not any("bf16" in trial.label for trial in prepared.trials)


def test_the_choice_is_logged_with_its_timings_and_gate_figures(
    conv_store: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    bf16_twice_as_fast(monkeypatch)
    worker = PreparedWorker(WorkerConfig(max_batch_size=4, bf16_units=True), "cpu", 1)
    with caplog.at_level(logging.INFO, logger="app.worker"):
        prepared = worker.load(auto_spec(conv_store))
    line = next(r.getMessage() for r in caplog.records if "serves, as" in r.getMessage())
    assert f"in bfloat16 serves, as {prepared.spec.served_id}" in line
    assert "openvino+bf16: 200.0 images/s, cosine" in line
    assert "torchscript: 100.0 images/s;" in line and "top-1 1.00" in line


async def test_info_shows_each_trial_and_the_id_names_the_precision_chosen(
    conv_store: Path,
) -> None:
    async with running_app(
        model_store=conv_store, cuda_devices="cpu", mb_worker_num=2, mb_dtype="auto",
        mb_test_cpu_bf16=True,
    ) as (_, client):  # fmt: skip
        image = distinct_images(1)[0]
        answer = await client.post("/predict/embedding", files={"image": ("a.png", image)})
        info = (await client.get("/info")).json()
    assert answer.status_code == 200, answer.text
    served = answer.headers["x-model-id"]
    held = [model for worker in info["workers"] for model in worker["models"]]
    assert len(held) == 2 and {model["served_id"] for model in held} == {served}  # one id
    dtype = held[0]["dtype"]
    assert served.endswith("+bf16") == (dtype == "bfloat16")
    trials = {trial["label"]: trial for trial in held[0]["trials"]}
    assert {"torchscript", "openvino", "torchscript+bf16", "openvino+bf16"} <= set(trials)
    assert trials["openvino+bf16"]["cosine_min"] >= 0.99 and trials["openvino+bf16"]["passed"]
    timed = {label: t["images_per_s"] for label, t in trials.items() if t["images_per_s"]}
    chosen = held[0]["runtime"] + ("+bf16" if dtype == "bfloat16" else "")
    # bf16 serves only if decisively faster than fp32 (the id must not flip with noise);
    # within the precision chosen, the fastest runtime serves.
    fp32 = {label: rate for label, rate in timed.items() if not label.endswith("+bf16")}
    bf16 = {label: rate for label, rate in timed.items() if label.endswith("+bf16")}
    decisive = max(bf16.values()) >= runtimes_module.DECISIVE * max(fp32.values())
    assert dtype == ("bfloat16" if decisive else "float32"), timed
    among = bf16 if decisive else fp32
    assert chosen == max(among, key=lambda label: among[label])


@needs_bf16
def test_the_default_model_passes_the_bf16_gate_and_still_tags_the_cat(
    default_store: Path, cat_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    choice = choose_runtime(
        default_store, CPU, LoadOptions(threads=2), "auto", dtypes=BOTH, bf16_units=True
    )
    trial = choice.trials["openvino+bf16"]
    assert trial.passed and trial.top1 == 1.0
    assert trial.cosine_min is not None and trial.cosine_min >= 0.99
    # bf16 serves only if decisively faster than fp32, the export's own (on a busy host it
    # can be the fastest and still not by the margin)
    rates = choice.images_per_s
    bf16_best = max(rate for label, rate in rates.items() if label.endswith("+bf16"))
    fp32_best = max(rate for label, rate in rates.items() if not label.endswith("+bf16"))
    decisive = bf16_best >= runtimes_module.DECISIVE * fp32_best
    assert (choice.dtype == torch.bfloat16) == decisive, rates
    bf16 = load_models(default_store, CPU, LoadOptions(dtype=torch.bfloat16, threads=2), "openvino")
    tags = BatchRunner(bf16, CPU).run(
        Task.TAG, photo_pixels(default_store, cat_jpeg, coffee_jpeg), 5
    )
    assert_cat_then_espresso(default_store, tags["indices"])


def _pixels(store: Path) -> npt.NDArray[np.uint8]:
    shape = read_manifest(store).input.image_shape
    return np.random.default_rng(0).integers(0, 256, (2, *shape), dtype=np.uint8)


@pytest.mark.parametrize("favoured", ["float32", "bfloat16"])
def test_the_test_hook_makes_a_precision_win_wherever_it_passes(
    conv_store: Path, favoured: str
) -> None:
    """MB_TEST_FASTEST_DTYPE, so every CPU covers both outcomes of the choice with real
    timings (those of a tiny model are noise); bf16 units are taken as there."""
    config = WorkerConfig(max_batch_size=4, bf16_units=True, fastest_dtype=favoured)
    prepared = PreparedWorker(config, "cpu", 1).load(auto_spec(conv_store))
    assert prepared.spec.dtype == favoured
    timed = {t.label: t.images_per_s for t in prepared.trials if t.images_per_s is not None}
    assert len(timed) == 4, timed  # every candidate was timed for real, then favoured


@pytest.mark.parametrize(
    ("incumbent", "bf16_rate", "chosen"),
    [
        (None, 120.0, torch.float32),  # faster, not decisively: fp32, the export's own
        (None, 130.0, torch.bfloat16),  # decisively faster
        (torch.bfloat16, 90.0, torch.bfloat16),  # chosen before, fp32 not decisively faster
        (torch.bfloat16, 70.0, torch.float32),  # fp32 decisively faster: it changes
    ],
)
def test_a_precision_serves_only_when_decisively_faster_than_the_one_kept(
    conv_store: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    incumbent: torch.dtype | None,
    bf16_rate: float,
    chosen: torch.dtype,
) -> None:
    """The served id names the precision, so MB_DTYPE=auto keeps the one it would serve in
    anyway (chosen on this host class before, else the export's fp32) unless another is at
    least 1.25x as fast; a change of a kept choice says so in one warning."""

    def rate(models: LoadedModels, device: torch.device, pixels: object) -> float:
        return bf16_rate if models.precision == "bfloat16" else 100.0

    monkeypatch.setattr(runtimes_module, "images_per_s", rate)
    with caplog.at_level(logging.WARNING, logger="app.worker"):
        choice = choose_runtime(
            conv_store, CPU, LoadOptions(threads=1), "auto", dtypes=BOTH, bf16_units=True,
            incumbent=incumbent,
        )  # fmt: skip
    assert choice.dtype == chosen
    changed = incumbent is not None and incumbent != chosen
    assert ("chosen on this host class before" in caplog.text) == changed
