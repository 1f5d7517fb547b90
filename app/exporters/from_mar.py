"""``python -m app.export --from-mar model.mar``: a TorchServe model archive as a model store.

- A TorchScript archive (its ``serializedFile`` a ScriptModule, no ``modelFile``) is the
  supported case. Where its graph ends in a linear layer (the head of a scripted or traced
  torchvision or timm classifier), it is split there into the embedding model and the head,
  and the halves must reproduce the whole model's logits on random images; otherwise the
  whole model serves tags only (``embedding_served`` false: its logits are never answered
  as an embedding).
- An eager archive (``modelFile`` and a state dict) is refused unless the import is told
  ``trust_code``: then ``app.exporters.mar_script`` imports its model file in a subprocess,
  loads the weights with ``weights_only=True``, scripts the model and saves it; the server
  never runs archive code.
- Preprocessing: the stock ``image_classifier`` handler's transform, to the pixel: the
  image decoded by Pillow at full size, torchvision's ``Resize(256)`` (Pillow's bilinear,
  the long side truncated as torchvision does), ``CenterCrop(224)`` (its offsets rounded as
  torchvision does), ``ToTensor`` and ``Normalize`` with ImageNet's mean and std
  (``InputSpec.resize`` "pil-resize-then-crop"); its softmax and top 5. A custom handler is
  never imported: its archive imports only with the preprocessing given by hand, made the
  same way. TorchServe's other stock handlers (segmentation, detection, text) are refused:
  their models answer no image's classes.
- Precision: an imported archive's answers are its handler's top 5, so a precision below
  fp32 serves it only where it keeps the top 5 of fp32, in order, on the images it is
  checked on (``Manifest.top5_contract``).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.exporters.base import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ExportError,
    override_input,
    random_images,
)
from app.exporters.mar import MAX_BYTES, Archive, unpack
from app.exporters.precision import PrecisionRequest
from app.exporters.store import DERIVED_RUNTIMES, REPO_ROOT, export_module, load_torchscript
from app.manifest import Imported, InputSpec, Manifest

log = logging.getLogger("app.export")

# The stock image_classifier handler's transform (ts/torch_handler/image_classifier.py,
# TorchServe 0.12): PIL.Image.open (a JPEG at full size), Resize(256), CenterCrop(224),
# ToTensor, Normalize(ImageNet); torchvision's default interpolation, bilinear.
STOCK_INPUT = InputSpec(
    crop_size=224,
    resize_size=256,
    interpolation="bilinear",
    mean=IMAGENET_MEAN,
    std=IMAGENET_STD,
    reduced_decode=False,
    resize="pil-resize-then-crop",
)
SPLIT_TOLERANCE = 1e-4  # relative to the logits' scale
SCRIPT_TIMEOUT_S = 600
EAGER_REFUSED = (
    "{path} is an eager archive: its model is Python code ({model_file}) and a state dict, "
    "which only running that code can rebuild. Convert it where the code lives: "
    "torch.jit.script(model) or torch.jit.trace(model, example) and torch-model-archiver "
    "--serialized-file model.pt (no --model-file); or `python -m app.export --arch NAME "
    "--weights state_dict.pt` for a torchvision or timm architecture. If you trust the "
    "archive, --trust-archive-code imports its model file in a separate process to script it."
)


def import_mar(
    path: Path,
    out: Path,
    *,
    preprocessing: dict[str, object] | None = None,
    runtimes: Collection[str] = DERIVED_RUNTIMES,
    precision: PrecisionRequest | None = None,
    trust_code: bool = False,
    max_bytes: int = MAX_BYTES,
) -> tuple[Manifest, Archive]:
    """Import the archive at ``path`` into the store ``out``. ``preprocessing``: InputSpec
    fields given by hand (required for a custom handler). Returns the manifest and what the
    archive said (its suggestions)."""
    with tempfile.TemporaryDirectory(prefix="mar-") as scratch:
        archive = unpack(path, Path(scratch) / "archive", max_bytes=max_bytes)
        given = bool(preprocessing)
        if archive.other_stock_answer is not None:
            raise ExportError(
                f"{path.name}'s handler is TorchServe's stock {archive.handler!r}: its model "
                f"answers {archive.other_stock_answer}, not an image's classes, which is what "
                "this server serves (with the stock image_classifier handler's answers)"
            )
        if not archive.stock_handler:
            if not given:
                raise ExportError(
                    f"{path.name}'s handler {archive.handler!r} is custom: this server never runs "
                    "it, so give its preprocessing by hand (--input-size, --resize-size, --mean, "
                    "--std, --interpolation; the stock image_classifier's are 224, 256, "
                    "ImageNet's, bilinear)"
                )
            log.warning(
                "WARNING: %s's handler %r is custom and is not run: its preprocessing is the one "
                "given on the command line, and answers are the stock handler's softmax top 5",
                path.name,
                archive.handler,
            )
        spec = override_input(STOCK_INPUT, preprocessing) if preprocessing else STOCK_INPUT
        scripted = archive.serialized
        if archive.model_file:
            if not trust_code:
                raise ExportError(
                    EAGER_REFUSED.format(path=path.name, model_file=archive.model_file)
                )
            scripted = _script_in_subprocess(archive, Path(scratch) / "scripted.pt", spec)
        model = load_torchscript(
            scripted,
            f"{path.name}: its serializedFile",
            hint="; an eager archive needs a modelFile",
        ).eval()
        imported = Imported(
            archive=path.name,
            model_name=archive.name,
            model_version=archive.version,
            handler=archive.handler,
            preprocessing="given by hand" if given else "stock image_classifier",
        )
        logits = _logits(model, spec, path)
        classes = archive.classes or [str(index) for index in range(logits.shape[1])]
        if len(classes) != logits.shape[1]:
            raise ExportError(
                f"{path.name}: index_to_name.json names {len(classes)} classes, the model "
                f"gives {logits.shape[1]} logits"
            )
        halves = split_at_head(model, spec)
        common: dict[str, Any] = {
            "input": spec,
            "classes": classes,
            "arch": archive.name,
            "weights": f"TorchServe archive {path.name} (version {archive.version})",
            "runtimes": runtimes,
            "precision": precision,
            "imported": imported,
        }
        if halves is not None:
            embedding, head = halves
            log.info("split %s at its final linear layer: embedding and head", path.name)
            return export_module(embedding, out, classifier=head, **common), archive
        log.warning(
            "%s's head could not be split off (its graph does not end in a linear layer): "
            "it serves tags only, /predict/embedding answers 404",
            path.name,
        )
        whole = export_module(
            model,
            out,
            classifier=torch.jit.script(nn.Identity()),
            embedding_served=False,
            **common,
        )
        return whole, archive


def _logits(model: nn.Module, spec: InputSpec, path: Path) -> torch.Tensor:
    with torch.inference_mode():
        try:
            logits = model(random_images(spec))
        except Exception as exc:
            raise ExportError(
                f"{path.name}: the model does not take [N, 3, {spec.crop_size}, "
                f"{spec.crop_size}] images ({type(exc).__name__}: {str(exc)[:200]})"
            ) from None
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2:
        raise ExportError(
            f"{path.name}: the model gives {type(logits).__name__}, not [N, K] logits"
        )
    return logits


def split_at_head(
    model: torch.jit.ScriptModule, spec: InputSpec
) -> tuple[torch.jit.ScriptModule, nn.Linear] | None:
    """``model`` as (embedding, head) where its frozen graph returns a linear layer's output
    whose weight and bias are constants, and the two reproduce its logits; else None."""
    images = random_images(spec)
    with torch.inference_mode():
        expected = model(images)
    try:
        frozen = torch.jit.freeze(model.eval())
    except Exception:
        return None
    graph = frozen.graph
    returned = graph.return_node()
    outputs = list(returned.inputs())
    if len(outputs) != 1 or outputs[0].node().kind() != "aten::linear":
        return None
    linear = outputs[0].node()
    features, weight, bias = list(linear.inputs())
    if weight.node().kind() != "prim::Constant":
        return None
    weight_value = weight.toIValue()
    bias_value = bias.toIValue() if bias.node().kind() == "prim::Constant" else None
    if not isinstance(weight_value, torch.Tensor) or weight_value.ndim != 2:
        return None
    head = nn.Linear(weight_value.shape[1], weight_value.shape[0], bias=bias_value is not None)
    with torch.no_grad():
        head.weight.copy_(weight_value)
        if bias_value is not None:
            head.bias.copy_(bias_value)
    returned.replaceInput(0, features)
    torch._C._jit_pass_dce(graph)
    with torch.inference_mode():
        pooled = frozen(images)
        if not isinstance(pooled, torch.Tensor) or pooled.ndim != 2:
            return None
        error = (head(pooled) - expected).abs().max().item()
    scale = max(1.0, expected.abs().max().item())
    return (frozen, head.eval()) if error <= SPLIT_TOLERANCE * scale else None


def _script_in_subprocess(archive: Archive, out: Path, spec: InputSpec) -> Path:
    """The eager archive's model, scripted by ``app.exporters.mar_script`` in a process of
    its own (the archive's code runs there, never here)."""
    assert archive.model_file is not None
    command = [
        sys.executable,
        "-m",
        "app.exporters.mar_script",
        str(archive.folder),
        archive.model_file,
        str(archive.serialized),
        str(out),
        str(spec.crop_size),
    ]
    log.warning("WARNING: running %s's model code (--trust-archive-code)", archive.path.name)
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S, cwd=REPO_ROOT
        )
    except subprocess.TimeoutExpired:
        raise ExportError(
            f"scripting {archive.path.name}'s model took over {SCRIPT_TIMEOUT_S} s"
        ) from None
    if done.returncode != 0 or not out.is_file():
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ExportError(f"{archive.path.name}'s model could not be scripted: {reason}")
    return out
