"""The export's building blocks on tiny modules: preprocessing from library configs, checkpoint
reading, label files and the checks that refuse a bad split or trace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from app.exporters.base import BuildRequest, ExportError, SplitModel, checked_split, input_spec
from app.exporters.checkpoints import load_state_dict
from app.exporters.store import export_module, export_split, labels_for, read_labels
from app.manifest import InputSpec

SPEC = InputSpec(crop_size=8, resize_size=8, mean=(0.5,) * 3, std=(0.5,) * 3)


def _spec(interpolation: str = "bilinear", size: tuple[int, int] = (224, 224)) -> InputSpec:
    return input_spec(
        what="m",
        size=size,
        resize_size=256,
        interpolation=interpolation,
        mean=(0.5,) * 3,
        std=(0.5,) * 3,
    )


@pytest.mark.parametrize(
    ("given", "used"), [("lanczos", "bicubic"), ("nearest", "bilinear"), ("hamming", "bilinear")]
)
def test_other_interpolations_map_to_the_nearest_with_a_warning(
    caplog: pytest.LogCaptureFixture, given: str, used: str
) -> None:
    caplog.set_level("WARNING")
    assert _spec(given).interpolation == used
    assert f"m resizes with {given!r}; the server will use {used!r}" in caplog.text


def test_bicubic_is_kept_quietly(caplog: pytest.LogCaptureFixture) -> None:
    assert _spec("bicubic").interpolation == "bicubic" and not caplog.text


def test_a_non_square_input_is_refused() -> None:
    with pytest.raises(ExportError, match="takes 224x320 images; the server crops squares only"):
        _spec(size=(224, 320))


def test_checkpoints_nest_state_dicts_and_data_parallel_prefixes(tmp_path: Path) -> None:
    weights = {"module.fc.weight": torch.ones(2, 2), "module.fc.bias": torch.zeros(2)}
    torch.save({"model": weights, "epoch": 3}, tmp_path / "ckpt.pth")
    assert set(load_state_dict(tmp_path / "ckpt.pth")) == {"fc.weight", "fc.bias"}


def test_safetensors_files_are_state_dicts(tmp_path: Path) -> None:
    save_file({"fc.weight": torch.ones(2, 2)}, str(tmp_path / "model.safetensors"))
    assert list(load_state_dict(tmp_path / "model.safetensors")) == ["fc.weight"]


@pytest.mark.parametrize("content", [{}, {"state_dict": {"lr": 0.1}}, [torch.ones(1)]])
def test_a_checkpoint_without_a_state_dict_is_refused(tmp_path: Path, content: object) -> None:
    torch.save(content, tmp_path / "ckpt.pth")
    with pytest.raises(ExportError, match="does not hold a state dict of tensors"):
        load_state_dict(tmp_path / "ckpt.pth")


def test_label_files(tmp_path: Path) -> None:
    path = tmp_path / "labels.txt"
    path.write_text("cat\r\ndog\n\n", encoding="utf-8")
    assert read_labels(path) == ["cat", "dog"]
    path.write_text("cat\n\ndog\n", encoding="utf-8")
    with pytest.raises(ExportError, match="line 2 is empty"):
        read_labels(path)
    path.write_text("\n", encoding="utf-8")
    with pytest.raises(ExportError, match="lists no class names"):
        read_labels(path)


def test_labels_default_to_imagenet_for_a_1000_way_head_only() -> None:
    assert labels_for(1000, None, "m")[0] == "tench"
    with pytest.raises(ExportError, match="has 3 outputs and no --classes was given"):
        labels_for(3, None, "m")
    with pytest.raises(ExportError, match="has 3 outputs, 2 class names given"):
        labels_for(3, ["a", "b"], "m")


def test_class_names_need_a_classifier() -> None:
    with pytest.raises(ExportError, match="class names need a classifier"):
        BuildRequest("random", num_classes=3, classifier=False)


def test_a_head_that_is_not_the_last_step_is_refused() -> None:
    # The "head" found (the Linear) is followed by a ReLU: embedding + head != the model.
    model = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 4), nn.ReLU())
    linear = model[2]
    assert isinstance(linear, nn.Linear)
    with torch.no_grad():
        linear.bias.fill_(-10.0)  # make the ReLU matter

    def cut() -> nn.Module:
        head = model[2]
        model[2] = nn.Identity()
        return head

    with pytest.raises(ExportError, match="cannot be split at its head"):
        checked_split(model, cut, SPEC, "m")


class _FixedBatch(nn.Module):
    """Reshapes with the batch size as a Python int, which a trace freezes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3)).reshape(int(x.shape[0]), 3)


def test_a_trace_that_fixes_the_batch_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="fails on a batch of 3 \\(traced on 2\\)"):
        export_module(_FixedBatch(), tmp_path, input=SPEC, arch="fixed")
    assert not (tmp_path / "manifest.json").exists()


def test_an_embedding_only_split_takes_no_class_names(tmp_path: Path) -> None:
    split = SplitModel(
        embedding=nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()),
        classifier=None,
        input=SPEC,
        embedding_dim=3,
        num_classes=0,
    )
    with pytest.raises(ExportError, match="1 class names for a model without a classifier"):
        export_split(split, arch="m", weights="random", out=tmp_path, classes=["a"])
    manifest = export_split(split, arch="m", weights="random", out=tmp_path)
    assert (manifest.num_classes, set(manifest.files)) == (0, {"embedding"})
