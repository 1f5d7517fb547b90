"""What every exporter shares: the error, the build request, the split model and its checks."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from app.errors import StartupError
from app.manifest import FileEntry, InputSpec
from app.workers.models import Model

log = logging.getLogger("app.export")

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# InputSpec knows bilinear and bicubic; libraries name a few more. Each maps to the nearer of
# the two in how it weighs neighbouring pixels.
INTERPOLATIONS = {
    "bilinear": "bilinear",
    "bicubic": "bicubic",
    "lanczos": "bicubic",
    "nearest": "bilinear",
    "nearest-exact": "bilinear",
    "box": "bilinear",
    "hamming": "bilinear",
}


# What to do when pretrained weights' head does not fit the labels of --classes.
PRETRAINED_HEAD_FIX = (
    "pass --weights PATH to a checkpoint fine-tuned with those labels, or --no-classifier"
)


class ExportError(StartupError):
    """Bad arguments, weights or model: the message says what to fix."""


@dataclass(frozen=True)
class BuildRequest:
    """How to build a library's model, decided once from the command line.

    ``weights``: "pretrained", "random" or the path of a checkpoint. ``num_classes``: the size
    of the head ``--classes`` asks for; None keeps the model's own head. ``classifier``: False
    exports the embedding model only.
    """

    weights: str = "pretrained"
    num_classes: int | None = None
    classifier: bool = True

    def __post_init__(self) -> None:
        if self.num_classes is not None and not self.classifier:
            raise ExportError("class names need a classifier: drop --classes or --no-classifier")
        if self.num_classes is not None and self.num_classes < 1:
            raise ExportError(f"a classifier needs at least one class, not {self.num_classes}")

    @property
    def checkpoint(self) -> Path | None:
        return None if self.weights in ("pretrained", "random") else Path(self.weights)


@dataclass
class SplitModel:
    """A model split at its pooled features, with how to feed it.

    ``classifier`` is None (and ``num_classes`` 0) for an embedding-only export.
    """

    embedding: nn.Module
    classifier: nn.Module | None
    input: InputSpec
    embedding_dim: int
    num_classes: int
    embedding_served: bool = True  # False: ``embedding`` gives the logits (an unsplit import)


@dataclass(frozen=True)
class Built:
    """A built model and, for the manifest, where its weights came from."""

    split: SplitModel
    weights: str


def input_spec(
    *,
    what: str,
    size: tuple[int, int],
    resize_size: int,
    interpolation: str,
    mean: tuple[float, ...],
    std: tuple[float, ...],
) -> InputSpec:
    """An InputSpec from a library's preprocessing config, refusing what the server cannot
    do (non-square crops, other than 3 channels)."""
    if size[0] != size[1]:
        raise ExportError(f"{what} takes {size[0]}x{size[1]} images; the server crops squares only")
    if len(mean) != 3 or len(std) != 3:
        raise ExportError(f"{what} normalises {len(mean)} channels; the server feeds RGB")
    mode = INTERPOLATIONS.get(interpolation.lower(), "bilinear")
    if mode != interpolation.lower():
        log.warning("%s resizes with %r; the server will use %r", what, interpolation, mode)
    return InputSpec(
        crop_size=size[0],
        resize_size=max(resize_size, size[0]),
        interpolation=mode,
        mean=(mean[0], mean[1], mean[2]),
        std=(std[0], std[1], std[2]),
    )


def random_images(spec: InputSpec, count: int = 2) -> torch.Tensor:
    """The export's check batch: seeded, so that two exports of the same model write the
    same programs and measure the same differences."""
    generator = torch.Generator().manual_seed(20261127)
    return torch.rand(count, 3, spec.crop_size, spec.crop_size, generator=generator)


def run(module: nn.Module, x: torch.Tensor, what: str) -> torch.Tensor:
    """``module(x)`` under no_grad; any failure becomes an ExportError naming ``what``."""
    try:
        with torch.no_grad():
            y = module(x)
    except Exception as exc:
        raise ExportError(
            f"{what} fails on a {tuple(x.shape)} batch: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(y, torch.Tensor):
        raise ExportError(f"{what} returns {type(y).__name__}, not a tensor")
    return y


def difference_at_any_batch(model: Model, example: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference of a derived ``model``'s outputs from ``expected`` (the
    reference's output on ``example``), on the example batch and on its first image alone:
    a model whose batch dimension got fixed at the example's size fails here."""
    with torch.no_grad():
        got, lone = model(example), model(example[:1])
    return max(float((got - expected).abs().max()), float((lone - expected[:1]).abs().max()))


Source = TypeVar("Source")


def derive_checked(
    what: str,
    models: Mapping[str, tuple[Source, torch.Tensor, torch.Tensor]],
    derive: Callable[[str, Source, torch.Tensor], tuple[dict[str, FileEntry], Model]],
    tolerance: float,
    remove: Callable[[], None],
) -> tuple[dict[str, FileEntry], float] | None:
    """Derive each ``role: (source, example batch, the TorchScript model's output on it)``
    with ``derive(role, source, example)``, which writes the role's files and returns them
    with the derived model loaded back; check that model at the example batch and at one
    image (``difference_at_any_batch``). The files and the largest difference, or, where
    anything failed or differs by more than ``tolerance``, a warning ("no <what> for this
    export: ..."), ``remove()`` of what was written, and None: TorchScript still serves."""
    files: dict[str, FileEntry] = {}
    worst = 0.0
    try:
        for role, (source, example, expected) in models.items():
            written, model = derive(role, source, example)
            worst = max(worst, difference_at_any_batch(model, example, expected))
            files |= written
    except Exception as exc:  # whatever the converter, compiler or runtime refuses
        log.warning("no %s for this export: %s: %s", what, type(exc).__name__, exc)
        remove()
        return None
    if worst > tolerance:
        log.warning(
            "no %s for this export: it differs from TorchScript by %.2g (> %g)",
            what,
            worst,
            tolerance,
        )
        remove()
        return None
    return files, worst


def features_dim(features: torch.Tensor, images: torch.Tensor, what: str) -> int:
    """The embedding size, checking that ``what`` gave one [D] vector per image."""
    if features.ndim != 2 or features.shape[0] != images.shape[0]:
        raise ExportError(
            f"{what} gives {tuple(features.shape)} for {images.shape[0]} images, not [N, D] "
            "pooled features"
        )
    return int(features.shape[1])


def checked_split(
    model: nn.Module, cut: Callable[[], nn.Module], spec: InputSpec, what: str
) -> SplitModel:
    """Split ``model`` at its head: ``cut()`` detaches the head and returns it, leaving
    ``model`` ending at the features. Refuses unless head(model(x)) reproduces the whole
    model's logits on a random batch (a head that is not the model's last step, say)."""
    model.eval()
    images = random_images(spec)
    logits = run(model, images, what)
    head = cut().eval()
    features = run(model, images, f"{what} without its head")
    dim = features_dim(features, images, f"{what} without its head")
    again = run(head, features, f"{what}'s head")
    if again.shape != logits.shape or not torch.allclose(again, logits, atol=1e-4, rtol=1e-4):
        raise ExportError(
            f"{what} cannot be split at its head: classifier(embedding(x)) does not reproduce "
            "its logits. Export it with --no-classifier, or split it yourself and use "
            "--from-torchscript"
        )
    return SplitModel(
        embedding=model,
        classifier=head,
        input=spec,
        embedding_dim=dim,
        num_classes=int(logits.shape[1]),
    )


def embedding_only(model: nn.Module, spec: InputSpec, what: str) -> SplitModel:
    model.eval()
    images = random_images(spec)
    dim = features_dim(run(model, images, what), images, what)
    return SplitModel(
        embedding=model, classifier=None, input=spec, embedding_dim=dim, num_classes=0
    )


def check_head_size(have: int, request: BuildRequest, what: str, fix: str) -> None:
    """Refuse a head that is not the size ``--classes`` asks for; ``fix`` says what to do."""
    if request.num_classes is None or have == request.num_classes:
        return
    head = f"a {have}-way classifier head" if have else "no classifier head"
    raise ExportError(f"{what} has {head} but --classes lists {request.num_classes} labels: {fix}")


def override_input(spec: InputSpec, fields: dict[str, object]) -> InputSpec:
    """``spec`` with ``fields`` replaced; a new crop size keeps the old resize/crop ratio
    unless the resize size is given too."""
    values = spec.model_dump() | fields
    if "crop_size" in fields and "resize_size" not in fields:
        values["resize_size"] = int(int(values["crop_size"]) * spec.resize_size / spec.crop_size)
    try:
        spec = InputSpec.model_validate(values)
    except ValueError as exc:
        raise ExportError(f"bad preprocessing: {exc}") from None
    if spec.resize_size < spec.crop_size or min(spec.std) <= 0:
        raise ExportError(
            f"bad preprocessing: resize {spec.resize_size} must be at least the crop "
            f"{spec.crop_size}, and std {spec.std} positive"
        )
    return spec
