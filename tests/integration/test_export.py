"""`python -m app.export`: architectures, weights sources and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision

from app.export import main
from app.manifest import read_classes, read_manifest
from app.workers.models import load_models

pytestmark = pytest.mark.slow


def test_unknown_arch_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--arch", "vgg99", "--weights", "random"])
    assert info.value.code == 2
    assert "invalid choice: 'vgg99'" in capsys.readouterr().err


@pytest.mark.parametrize("content", [None, b"not a checkpoint", b""])
def test_unreadable_weights_are_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None
) -> None:
    weights = tmp_path / "w.pth"
    if content is not None:
        weights.write_bytes(content)
    assert (
        main(["--arch", "resnet18", "--weights", str(weights), "--out", str(tmp_path / "o")]) == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "w.pth" in err and "Traceback" not in err
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_weights_for_another_arch_are_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = tmp_path / "r18.pth"
    torch.save(torchvision.models.resnet18().state_dict(), weights)
    assert main(["--arch", "resnet50", "--weights", str(weights), "--out", str(tmp_path)]) == 2
    assert "does not fit resnet50" in capsys.readouterr().err


def test_resnet18_from_a_local_weights_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    reference = torchvision.models.resnet18().eval()
    weights = tmp_path / "resnet18.pth"
    torch.save(reference.state_dict(), weights)
    out = tmp_path / "store"
    assert main(["--arch", "resnet18", "--weights", str(weights), "--out", str(out)]) == 0
    manifest = read_manifest(out)
    assert (manifest.arch, manifest.embedding_dim, manifest.num_classes) == ("resnet18", 512, 1000)
    assert manifest.weights.startswith("file:resnet18.pth sha256:")
    assert manifest.input.mean == (0.485, 0.456, 0.406)
    assert read_classes(out, manifest)[0] == "tench"
    models = load_models(out, torch.device("cpu"))
    assert models.classifier is not None  # exported with its head
    x = torch.rand(3, 3, 224, 224)
    with torch.inference_mode():
        logits = models.classifier(models.embedding(x))
        torch.testing.assert_close(logits, reference(x), atol=1e-4, rtol=1e-4)


def test_random_weights_warn_loudly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING")
    assert main(["--arch", "resnet18", "--weights", "random", "--out", str(tmp_path)]) == 0
    assert "RANDOM weights" in caplog.text
    assert read_manifest(tmp_path).weights == "random"
