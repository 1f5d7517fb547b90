"""torchvision classification models: any name in
``torchvision.models.list_models(module=torchvision.models)``.

The head is the model's last ``nn.Linear`` (resnet ``fc``, efficientnet/mobilenet/convnext
``classifier[-1]``, vit ``heads.head``, swin ``head``...); the preprocessing is the metadata
of the model's default weights (``transforms()`` builds a transform object: no download).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

from app.exporters.base import (
    PRETRAINED_HEAD_FIX,
    BuildRequest,
    Built,
    ExportError,
    SplitModel,
    check_head_size,
    checked_split,
    embedding_only,
    input_spec,
)
from app.exporters.checkpoints import (
    describe,
    head_outputs,
    hub_checkpoint,
    load_state_dict,
    load_strict,
)
from app.manifest import InputSpec


def build(name: str, request: BuildRequest, *, arch: str) -> Built:
    """Build torchvision's ``name`` as ``request`` asks and split it at its last Linear."""
    default = torchvision.models.get_model_weights(name).DEFAULT
    path = request.checkpoint
    head: str | None
    if path is not None:
        model, head = _from_checkpoint(name, load_state_dict(path), request, path, arch)
        weights = describe(path)
    elif request.weights == "random":
        model = _create(name, num_classes=request.num_classes)
        head, weights = _head_name(model, arch), "random"
    else:
        model, weights = _pretrained(name, default, request), f"pretrained:torchvision:{default}"
        head = _head_name(model, arch)
    return Built(_split(model, head, request, model_input(default, arch), arch), weights)


def _create(name: str, **kwargs: Any) -> nn.Module:
    kwargs = {key: value for key, value in kwargs.items() if value is not None}
    try:
        model: nn.Module = torchvision.models.get_model(name, **kwargs)
    except Exception as exc:
        raise ExportError(f"torchvision cannot build {name}: {type(exc).__name__}: {exc}") from None
    return model


def _pretrained(name: str, default: Any, request: BuildRequest) -> nn.Module:
    cached = hub_checkpoint(default.url)
    if not cached.is_file():
        raise ExportError(
            f"torchvision's pretrained weights for {name} ({default}) are not in torch.hub's "
            f"cache ({cached}), and the export never downloads. Pass --weights PATH to a "
            f"checkpoint, --weights random (tests only), or put {default.url} at {cached}"
        )
    check_head_size(len(default.meta["categories"]), request, f"{default}", PRETRAINED_HEAD_FIX)
    # torch.hub loads a checkpoint that is already in its cache without going online.
    return _create(name, weights=default)


def _head_name(model: nn.Module, arch: str) -> str:
    linears: list[str] = [
        name for name, module in model.named_modules() if isinstance(module, nn.Linear)
    ]
    if not linears:
        raise ExportError(
            f"{arch} has no nn.Linear classifier head to split off; split it yourself and "
            "export it with --from-torchscript"
        )
    return linears[-1]


def _replace(model: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at ``path`` (e.g. "classifier.3") and return what was there."""
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    old = parent.get_submodule(child)
    setattr(parent, child, new)
    return old


def _from_checkpoint(
    name: str, state: dict[str, torch.Tensor], request: BuildRequest, path: Path, arch: str
) -> tuple[nn.Module, str | None]:
    """The model built with the checkpoint's head size, its weights loaded, and its head's
    path (None for a backbone saved without one)."""
    model = _create(name, num_classes=request.num_classes)
    head: str | None = _head_name(model, arch)
    outputs = head_outputs(state, str(head))
    check_head_size(outputs, request, path.name, "pass the labels it was trained with")
    if outputs == 0:
        _replace(model, str(head), nn.Identity())
        head = None
    elif outputs != model.get_submodule(str(head)).out_features:
        model = _create(name, num_classes=outputs)
    load_strict(model, state, path, arch)
    return model, head


def _split(
    model: nn.Module, head: str | None, request: BuildRequest, spec: InputSpec, arch: str
) -> SplitModel:
    if head is None:
        return embedding_only(model, spec, arch)
    if not request.classifier:
        _replace(model, head, nn.Identity())
        return embedding_only(model, spec, arch)
    return checked_split(model, lambda: _replace(model, head, nn.Identity()), spec, arch)


def model_input(weights: Any, arch: str) -> InputSpec:
    """The preprocessing of torchvision's ``weights``, from their metadata."""
    transform = weights.transforms()
    crop, resize = list(transform.crop_size), list(transform.resize_size)
    return input_spec(
        what=arch,
        size=(crop[0], crop[-1]),
        resize_size=resize[0],
        interpolation=str(transform.interpolation.value),
        mean=tuple(transform.mean),
        std=tuple(transform.std),
    )
