"""Running a batch of pixels through the models on one device, and finding the batch size
that device runs best (``MB_BATCH_SIZE=auto``)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from app.jobs import Task
from app.manifest import InputSpec
from app.workers.models import LoadedModels

# A batch of uint8 [n, H, W, 3] images: numpy from the shared buffer or Pillow, or a tensor
# already on the device (MB_DECODE=device).
Pixels = npt.NDArray[np.uint8] | torch.Tensor


class BatchRunner:
    """Turns a uint8 NHWC batch into model outputs on one device. Also usable in-process
    (tests, the benchmark) without any pipe or buffer."""

    def __init__(self, models: LoadedModels, device: torch.device) -> None:
        self.models = models
        self.device = device
        spec: InputSpec = models.manifest.input
        # (x / 255 - mean) / std == x * scale + shift, folded into one fused op per channel.
        std = torch.tensor(spec.std, dtype=torch.float32)
        mean = torch.tensor(spec.mean, dtype=torch.float32)
        self._scale = (1.0 / (255.0 * std)).view(1, 3, 1, 1).to(device)
        self._shift = (-mean / std).view(1, 3, 1, 1).to(device)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return self.models.manifest.input.image_shape

    def to_input(self, pixels: Pixels) -> torch.Tensor:
        """uint8 [n, H, W, 3] -> normalised float32 [n, 3, H, W] (channels-last in memory)."""
        batch = pixels if isinstance(pixels, torch.Tensor) else torch.from_numpy(pixels)
        batch = batch.to(self.device, non_blocking=True)
        normalised = torch.addcmul(self._shift, batch.permute(0, 3, 1, 2).float(), self._scale)
        return normalised.to(self.models.dtype)

    def _model_input(self, pixels: Pixels) -> torch.Tensor:
        """What the embedding model takes: the pixels where it normalises them itself."""
        if self.models.pixels_in:
            return pixels if isinstance(pixels, torch.Tensor) else torch.from_numpy(pixels)
        return self.to_input(pixels)

    def features(self, pixels: Pixels) -> torch.Tensor:
        """The embedding model's output for uint8 [n, H, W, 3] ``pixels`` (normalised here,
        or by the model itself where it takes pixels)."""
        return self.models.embedding(self._model_input(pixels))

    def outputs(
        self, pixels: Pixels, logits: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The features of ``pixels`` and, with ``logits`` (and a classifier), its logits:
        from one call where the models run as one (``LoadedModels.joint``)."""
        if logits and self.models.joint is not None:
            return self.models.joint(self._model_input(pixels))
        features = self.features(pixels)
        if not logits or self.models.classifier is None:
            return features, None
        return features, self.models.classifier(features)

    @property
    def full_task(self) -> Task:
        """The task that runs every model this worker has (for warm-up and measuring)."""
        return Task.TAG if self.models.classifier is not None else Task.EMBEDDING

    def run(self, task: Task, pixels: Pixels, top_k: int) -> dict[str, Any]:
        """One pass of the batch through the model: ``{"embedding": [n, dim]}`` for
        ``EMBEDDING``, ``{"indices": [n, top_k], "probs": [n, top_k]}`` for ``TAG``, all three
        for ``EMBEDDING_AND_TAG`` (the classifier head runs on the same features)."""
        if task is not Task.EMBEDDING and self.models.classifier is None:
            raise RuntimeError("this model has no classifier")
        with torch.inference_mode():
            features, logits = self.outputs(pixels, logits=task is not Task.EMBEDDING)
            outputs: dict[str, Any] = {}
            if task is not Task.TAG:
                outputs["embedding"] = features.float().cpu().numpy()
            if logits is None:
                return outputs
            probs = torch.softmax(logits.float(), dim=1)
            values, indices = torch.topk(probs, k=top_k, dim=1)
            outputs.update(indices=indices.cpu().numpy(), probs=values.cpu().numpy())
            return outputs

    def warm_up(self, largest: int = 1) -> None:
        """The TorchScript executor optimises on its first calls: make those now; then one
        call at the ``largest`` batch, so the memory it needs is held from the start."""
        warm = np.zeros((1, *self.image_shape), dtype=np.uint8)
        for _ in range(2):
            self.run(self.full_task, warm, top_k=1)
        if largest > 1:
            self.run(self.full_task, np.zeros((largest, *self.image_shape), np.uint8), top_k=1)


# A batch size is worth it only if it is this close to the best throughput seen: among
# near-equals, the smaller batch answers sooner.
KNEE_FRACTION = 0.95
# Stop trying bigger batches once one call takes this long: a batch that slow would add its
# whole duration to the latency of every request in it.
AUTO_BATCH_MAX_CALL_S = 1.0
# Each size is timed in this many rounds and keeps its best: workers measure at the same time
# and share the cores, and interference only ever slows a timing down.
AUTO_BATCH_ROUNDS = 3
AUTO_BATCH_MIN_TIMING_S = 0.1


def _images_per_s(runner: BatchRunner, pixels: npt.NDArray[np.uint8]) -> tuple[float, float]:
    """Images/s of back-to-back calls for at least ``AUTO_BATCH_MIN_TIMING_S``, and the
    seconds one call took."""
    calls, started = 0, time.perf_counter()
    while calls < 1 or time.perf_counter() - started < AUTO_BATCH_MIN_TIMING_S:
        runner.run(runner.full_task, pixels, 1)
        calls += 1
    elapsed = time.perf_counter() - started
    return len(pixels) * calls / elapsed, elapsed / calls


def choose_batch_size(
    runner: BatchRunner, image_shape: tuple[int, int, int], upper: int
) -> tuple[int, dict[int, float]]:
    """Measure images/s at batch sizes 1, 2, 4, ... <= ``upper`` on this worker's device and
    return the smallest size within ``KNEE_FRACTION`` of the best, with the measurements.
    Each size is timed in ``AUTO_BATCH_ROUNDS`` rounds and keeps its best timing."""
    batches: list[npt.NDArray[np.uint8]] = []
    throughput: dict[int, float] = {}
    size, past_the_knee = 1, 0
    while size <= upper:  # the first round also finds how far to grow
        pixels = np.zeros((size, *image_shape), dtype=np.uint8)
        runner.run(runner.full_task, pixels, 1)  # first call at a new shape may be slower
        batches.append(pixels)
        throughput[size], call_s = _images_per_s(runner, pixels)
        # Two sizes in a row well below the best so far: throughput is falling (on a CPU,
        # activations outgrow the caches), and bigger batches only cost start-up time.
        below = throughput[size] < KNEE_FRACTION * max(throughput.values())
        past_the_knee = past_the_knee + 1 if below else 0
        if call_s > AUTO_BATCH_MAX_CALL_S or past_the_knee == 2:
            break
        size *= 2
    for _ in range(AUTO_BATCH_ROUNDS - 1):
        for pixels in batches:
            throughput[len(pixels)] = max(throughput[len(pixels)], _images_per_s(runner, pixels)[0])
    best = max(throughput.values())
    chosen = min(s for s, rate in throughput.items() if rate >= KNEE_FRACTION * best)
    return chosen, throughput
