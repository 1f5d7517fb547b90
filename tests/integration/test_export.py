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


def test_the_same_weights_exported_twice_get_the_same_id_and_other_weights_another(
    tmp_path: Path,
) -> None:
    """The served id is the digest of what computes the answer: two exports of the same
    weights (one of them into another folder, later, in the same process) share it; the
    same weights scaled get another (their classifier's digest is the same: only the
    embedding's graph differs)."""
    from tests.models import export_scaled, export_tiny

    first = read_manifest(export_tiny(tmp_path / "a"))
    again = read_manifest(export_tiny(tmp_path / "elsewhere" / "b"))
    scaled = read_manifest(export_scaled(tmp_path / "c", 2.0))
    assert first.content is not None and first.content.modules == again.content.modules  # type: ignore[union-attr]
    assert first.served_id("auto") == again.served_id("auto")
    assert scaled.served_id("auto") != first.served_id("auto")
    assert scaled.content.modules["classifier"] == first.content.modules["classifier"]  # type: ignore[union-attr]


def test_a_module_replaced_under_a_rewritten_checksum_is_refused(tmp_path: Path) -> None:
    """Someone swaps embedding.pt for another model and rewrites its sha256 in the manifest:
    the files verify, but the module is not what the id says: the worker refuses it (step
    verify), before it could answer under another model's id."""
    import json

    from app.manifest import sha256_file
    from app.plan import WorkerConfig
    from app.repository import Repository
    from app.workers.process import LoadFailure, PreparedWorker
    from tests.models import export_scaled, export_tiny

    store = export_tiny(tmp_path / "tiny")
    other = export_scaled(tmp_path / "scaled", 3.0)
    (store / "embedding.pt").write_bytes((other / "embedding.pt").read_bytes())
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["files"]["embedding"]["sha256"] = sha256_file(store / "embedding.pt")
    (store / "manifest.json").write_text(json.dumps(manifest))
    spec = Repository.of_store(store).read("tiny-test", 1, "auto").spec  # the files verify
    worker = PreparedWorker(WorkerConfig(max_batch_size=2, runtime="torchscript"), "cpu", 1)
    with pytest.raises(LoadFailure) as failure:
        worker.load(spec)
    assert failure.value.step == "verify"
    assert "does not compute what its manifest's id says" in failure.value.message
    assert worker.models == {}
