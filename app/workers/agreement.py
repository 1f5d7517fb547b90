"""How far one set of loaded models is from another on the same images: what the export
measures a precision below fp32 by (its gate), and what a worker measures a runtime by
before it serves with it (its self-test). One measurement, so the two always agree on what
they compare."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from app.manifest import Agreement
from app.workers.models import LoadedModels
from app.workers.runner import BatchRunner

CPU = torch.device("cpu")
CHUNK = 16  # images per model call while measuring
TOP_K = 5


def _outputs(
    models: LoadedModels, pixels: npt.NDArray[np.uint8]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The embeddings (float32) and, with a classifier, the logits of ``pixels``."""
    runner = BatchRunner(models, CPU)
    features, logits = [], []
    with torch.inference_mode():
        for start in range(0, len(pixels), CHUNK):
            batch, batch_logits = runner.outputs(pixels[start : start + CHUNK])
            features.append(batch.float())
            if batch_logits is not None:
                logits.append(batch_logits.float())
    return torch.cat(features), (torch.cat(logits) if logits else None)


def measure(
    reference: LoadedModels, candidate: LoadedModels, pixels: npt.NDArray[np.uint8]
) -> Agreement:
    """``candidate``'s agreement with ``reference`` on ``pixels`` (uint8 [n, H, W, 3]).
    ValueError if their embeddings or logits differ in shape."""
    return _compare(_outputs(reference, pixels), _outputs(candidate, pixels))


def measure_pixels(
    models: LoadedModels, reference: npt.NDArray[np.uint8], candidate: npt.NDArray[np.uint8]
) -> Agreement:
    """How far ``models``' answers on ``candidate`` pixels are from its answers on the
    ``reference`` pixels of the same images (another decoder's, say)."""
    return _compare(_outputs(models, reference), _outputs(models, candidate))


def _compare(
    reference: tuple[torch.Tensor, torch.Tensor | None],
    candidate: tuple[torch.Tensor, torch.Tensor | None],
) -> Agreement:
    (ref_features, ref_logits), (features, logits) = reference, candidate
    if features.shape != ref_features.shape:
        raise ValueError(
            f"embedding shape {tuple(features.shape)}, expected {tuple(ref_features.shape)}"
        )
    cosine = torch.nn.functional.cosine_similarity(features, ref_features)
    top1 = top5 = top5_same = None
    if ref_logits is not None and logits is not None:
        if logits.shape != ref_logits.shape:
            shapes = tuple(logits.shape), tuple(ref_logits.shape)
            raise ValueError("logits shape {}, expected {}".format(*shapes))
        k = min(TOP_K, ref_logits.shape[1])
        expected, got = ref_logits.topk(k).indices, logits.topk(k).indices
        top1 = float((expected[:, 0] == got[:, 0]).float().mean())
        overlap = (expected.unsqueeze(2) == got.unsqueeze(1)).any(dim=2).float().sum(dim=1) / k
        top5 = float(overlap.mean())
        top5_same = float((expected == got).all(dim=1).float().mean())
    return Agreement(
        images=len(cosine),
        top1=top1,
        top5=top5,
        top5_same=top5_same,
        cosine_mean=float(cosine.mean()),
        cosine_min=float(cosine.min()),
    )
