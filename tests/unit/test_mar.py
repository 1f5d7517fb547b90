"""Reading TorchServe archives safely (app.exporters.mar) and what the import refuses or
records (app.exporters.from_mar): hostile zips, eager archives, custom handlers, classes in
both of index_to_name.json's forms, model-config.yaml's suggestions."""

from __future__ import annotations

import json
import re
import stat
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from app.export import main as export_main
from app.exporters.base import ExportError
from app.exporters.from_mar import STOCK_INPUT, import_mar, split_at_head
from app.exporters.mar import read_classes, unpack
from app.manifest import read_manifest


def write_mar(path: Path, files: dict[str, bytes], model: dict[str, str] | None = None) -> Path:
    """A .mar as torch-model-archiver lays it out: the files, and MAR-INF/MANIFEST.json."""
    manifest = {
        "runtime": "python",
        "model": {"modelName": "m", "serializedFile": "m.pt", "handler": "image_classifier"}
        | (model or {}),
    }
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr("MAR-INF/MANIFEST.json", json.dumps(manifest))
    return path


class Pooled(nn.Module):
    """A small CNN whose logits come from a 1x1 convolution and a mean: no linear head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, stride=4), nn.ReLU())
        self.head = nn.Conv2d(8, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.body(x)).mean(dim=(2, 3))
        return logits


class Linear(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, stride=4), nn.ReLU())
        self.fc = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.fc(self.body(x).mean(dim=(2, 3)))
        return logits


def scripted_bytes(module: nn.Module, tmp_path: Path) -> bytes:
    torch.manual_seed(0)
    file = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(module.eval()), str(file))
    return file.read_bytes()


@pytest.mark.parametrize(
    "name",
    ["../evil.py", "/etc/evil", "a/../../evil", "C:evil", "..\\evil"],
)
def test_a_member_outside_the_archive_folder_refuses_it(tmp_path: Path, name: str) -> None:
    mar = write_mar(tmp_path / "slip.mar", {"m.pt": b"x", name: b"boom"})
    with pytest.raises(ExportError, match="outside"):
        unpack(mar, tmp_path / "out")
    assert not (tmp_path / "evil.py").exists()


def test_a_symlink_member_refuses_the_archive(tmp_path: Path) -> None:
    mar = tmp_path / "link.mar"
    write_mar(mar, {"m.pt": b"x"})
    with zipfile.ZipFile(mar, "a") as archive:
        link = zipfile.ZipInfo("index_to_name.json")
        link.external_attr = (stat.S_IFLNK | 0o777) << 16
        archive.writestr(link, "/etc/passwd")
    with pytest.raises(ExportError, match="symlink"):
        unpack(mar, tmp_path / "out")


def test_an_archive_that_unpacks_past_the_limit_is_refused_while_unpacking(tmp_path: Path) -> None:
    # 64 MB of zeros compress to ~64 KB: a bomb in miniature.
    mar = tmp_path / "bomb.mar"
    with zipfile.ZipFile(mar, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("m.pt", bytes(64 << 20))
        archive.writestr("MAR-INF/MANIFEST.json", "{}")
    assert mar.stat().st_size < 1 << 20
    with pytest.raises(ExportError, match="more than 1048576 bytes"):
        unpack(mar, tmp_path / "out", max_bytes=1 << 20)
    written = sum(f.stat().st_size for f in (tmp_path / "out").rglob("*") if f.is_file())
    assert written <= 1 << 20


def test_what_is_not_a_mar_is_refused_clearly(tmp_path: Path) -> None:
    not_zip = tmp_path / "m.mar"
    not_zip.write_bytes(b"not a zip")
    with pytest.raises(ExportError, match=re.escape("not a zip .mar")):
        unpack(not_zip, tmp_path / "a")
    no_manifest = tmp_path / "n.mar"
    with zipfile.ZipFile(no_manifest, "w") as archive:
        archive.writestr("m.pt", b"x")
    with pytest.raises(ExportError, match=re.escape("no MAR-INF/MANIFEST.json")):
        unpack(no_manifest, tmp_path / "b")
    missing = write_mar(tmp_path / "x.mar", {})
    with pytest.raises(ExportError, match=re.escape("serializedFile 'm.pt' is not in the archive")):
        unpack(missing, tmp_path / "c")


def test_classes_are_read_in_both_forms_torchserve_takes(tmp_path: Path) -> None:
    plain, imagenet = tmp_path / "plain.json", tmp_path / "imagenet.json"
    plain.write_text(json.dumps({"1": "goldfish", "0": "tench"}))
    imagenet.write_text(json.dumps({"0": ["n01440764", "tench"], "1": ["n01443537", "goldfish"]}))
    assert read_classes(plain) == read_classes(imagenet) == ["tench", "goldfish"]
    gap = tmp_path / "gap.json"
    gap.write_text(json.dumps({"0": "a", "2": "c"}))
    with pytest.raises(ExportError, match=re.escape("not 0..1")):
        read_classes(gap)


def test_an_eager_archive_is_refused_with_how_to_convert_it(tmp_path: Path) -> None:
    mar = write_mar(
        tmp_path / "eager.mar",
        {"m.pt": b"state dict", "model.py": b"raise SystemExit('never run')"},
        {"modelFile": "model.py"},
    )
    with pytest.raises(ExportError) as refused:
        import_mar(mar, tmp_path / "store")
    message = str(refused.value)
    assert "eager archive" in message and "torch.jit.script" in message
    assert "--trust-archive-code" in message
    assert not (tmp_path / "store" / "manifest.json").exists()


def test_a_trusted_eager_archive_is_scripted_in_another_process(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Linear()
    weights = tmp_path / "weights.pt"
    torch.save(model.state_dict(), weights)
    code = (
        "import torch\nfrom torch import nn\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, stride=4), nn.ReLU())\n"
        "        self.fc = nn.Linear(8, 10)\n\n"
        "    def forward(self, x: torch.Tensor) -> torch.Tensor:\n"
        "        return self.fc(self.body(x).mean(dim=(2, 3)))\n"
    )
    mar = write_mar(
        tmp_path / "eager.mar",
        {"m.pt": weights.read_bytes(), "model.py": code.encode()},
        {"modelFile": "model.py"},
    )
    manifest, _ = import_mar(mar, tmp_path / "store", trust_code=True, runtimes=())
    assert manifest.num_classes == 10 and manifest.embedding_served  # split at its fc
    images = torch.rand(2, 3, 224, 224)
    store = tmp_path / "store"
    embedding = torch.jit.load(str(store / "embedding.pt"))  # type: ignore[no-untyped-call]
    head = torch.jit.load(str(store / "classifier.pt"))  # type: ignore[no-untyped-call]
    with torch.inference_mode():
        torch.testing.assert_close(head(embedding(images)), model.eval()(images))


def test_a_graph_ending_in_a_linear_layer_splits_and_another_does_not() -> None:
    torch.manual_seed(0)
    linear = torch.jit.script(Linear().eval())
    halves = split_at_head(linear, STOCK_INPUT)
    assert halves is not None
    embedding, head = halves
    images = torch.rand(3, 3, 224, 224)
    with torch.inference_mode():
        assert embedding(images).shape == (3, 8)
        torch.testing.assert_close(head(embedding(images)), linear(images))
    assert split_at_head(torch.jit.script(Pooled().eval()), STOCK_INPUT) is None


def test_an_unsplit_model_serves_tags_only_and_says_so(tmp_path: Path) -> None:
    classes = {str(i): [f"n{i}", f"class {i}"] for i in range(10)}
    config = b"batchSize: 8\nmaxBatchDelay: 50\nminWorkers: 2\n"
    mar = write_mar(
        tmp_path / "cnn.mar",
        {
            "m.pt": scripted_bytes(Pooled(), tmp_path),
            "index_to_name.json": json.dumps(classes).encode(),
            "model-config.yaml": config,
        },
        {"configFile": "model-config.yaml", "modelVersion": "2.0"},
    )
    manifest, archive = import_mar(mar, tmp_path / "store", runtimes=())
    assert not manifest.embedding_served and manifest.num_classes == 10
    # The stock transform, to the pixel: Pillow at full size, resized whole, then cropped.
    assert manifest.input.resize == "pil-resize-then-crop" and not manifest.input.reduced_decode
    assert manifest.top5_contract
    assert manifest.embedding_dim == 10  # the logits, never answered as an embedding
    assert manifest.imported is not None
    assert manifest.imported.preprocessing == "stock image_classifier"
    assert manifest.imported.model_version == "2.0"
    assert archive.suggestions() == [
        "MB_BATCH_SIZE=8  (batchSize: 8)",
        "MB_MAX_LATENCY=0.05  (maxBatchDelay: 50 ms)",
        "MB_WORKER_NUM=2  (minWorkers: 2)",
    ]
    read = read_manifest(tmp_path / "store")
    assert read.embedding_served is False
    assert (tmp_path / "store" / "classes.txt").read_text().splitlines()[3] == "class 3"


def test_a_custom_handler_needs_its_preprocessing_given_by_hand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mar = write_mar(
        tmp_path / "custom.mar",
        {"m.pt": scripted_bytes(Linear(), tmp_path), "handler.py": b"raise SystemExit(3)"},
        {"handler": "handler.py"},
    )
    store = tmp_path / "store"
    assert export_main(["--from-mar", str(mar), "--out", str(store), "--runtimes", "none"]) == 2
    assert "is custom" in capsys.readouterr().err
    args = ["--from-mar", str(mar), "--out", str(store), "--runtimes", "none"]
    assert export_main([*args, "--input-size", "160", "--mean", "0.5,0.5,0.5"]) == 0
    manifest = read_manifest(store)
    assert manifest.imported is not None
    assert manifest.imported.preprocessing == "given by hand"
    assert manifest.input.crop_size == 160 and manifest.input.mean == (0.5, 0.5, 0.5)
    assert manifest.imported.handler == "handler.py"


@pytest.mark.parametrize(
    "handler", ["image_segmenter", "ts.torch_handler.object_detector", "text_classifier"]
)
def test_torchserves_other_stock_handlers_are_refused_saying_what_they_answer(
    tmp_path: Path, handler: str, capsys: pytest.CaptureFixture[str]
) -> None:
    mar = write_mar(
        tmp_path / "m.mar", {"m.pt": scripted_bytes(Linear(), tmp_path)}, {"handler": handler}
    )
    args = ["--from-mar", str(mar), "--out", str(tmp_path / "store"), "--runtimes", "none"]
    assert export_main(args) == 2
    error = capsys.readouterr().err
    assert f"TorchServe's stock {handler!r}" in error and "not an image's classes" in error
