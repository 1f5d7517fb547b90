"""Test-only models. Fault injection lives here, never in the app: a slow model (to hold
requests in flight) and a model that fails on a marker image."""

from __future__ import annotations

import functools
import time
from collections.abc import Collection
from pathlib import Path

import numpy as np
import torch
from torch import nn

from app.export import PrecisionRequest, SplitModel, export_split
from app.manifest import InputSpec

TINY_DIM = 48
TINY_INPUT = InputSpec(
    crop_size=32,
    resize_size=36,
    interpolation="bilinear",
    mean=(0.0, 0.0, 0.0),
    std=(1.0, 1.0, 1.0),
)
CLASSES = [f"class_{i}" for i in range(1000)]
POISON_RGB = (255, 0, 255)


class TinyEmbedding(nn.Module):
    """4x4 average pooling of the normalised image: the embedding encodes its input, so each
    answer can be checked against its own upload."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled: torch.Tensor = self.pool(x)
        return pooled.flatten(1)


class ScaledEmbedding(TinyEmbedding):
    """TinyEmbedding times ``scale``: another version of the tiny model, whose every answer
    tells which version computed it."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class HeavyEmbedding(TinyEmbedding):
    """TinyEmbedding carrying ``megabytes`` of unused weights: a model whose files alone are
    over a small MB_MODEL_MEMORY."""

    ballast: torch.Tensor  # a buffer, registered in __init__

    def __init__(self, megabytes: int) -> None:
        super().__init__()
        self.register_buffer("ballast", torch.ones(megabytes * (1 << 18)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Sliced by the input's batch size, so freezing cannot fold the ballast away.
        return super().forward(x) + 0.0 * self.ballast[: x.shape[0]].sum()


class ConvEmbedding(nn.Module):
    """A convolution, then TinyEmbedding's pooling: a model with weights for int8 to quantize
    (the pooling alone has none)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, kernel_size=3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled: torch.Tensor = self.pool(torch.relu(self.conv(x)))
        return pooled.flatten(1)


class FragileClassifier(nn.Module):
    """A classifier head whose top-1 class bf16 changes and fp32 keeps: it adds 256 to the
    embedding (in [0, 1]) before its layer and takes the constant back after. In fp32 the
    embedding survives; rounded to bf16 (8 significant bits, steps of 2 at 256) it does not,
    and every image gets class 3, the class with the largest bias. The weights are exact in
    bf16, so that part of the answer is computed alike in both."""

    offset: torch.Tensor
    bias: torch.Tensor  # buffers, registered in __init__

    def __init__(self) -> None:
        super().__init__()
        weight = torch.round(torch.rand(1000, TINY_DIM, generator=_seeded()) * 40) / 512
        weight[3] = 0.0
        self.layer = nn.Linear(TINY_DIM, 1000, bias=False)
        self.layer.weight.data = weight
        bias = torch.zeros(1000)
        bias[3] = 0.25
        self.register_buffer("offset", weight.sum(dim=1) * 256.0)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.layer(x + 256.0) - self.offset + self.bias
        return logits


def _seeded() -> torch.Generator:
    return torch.Generator().manual_seed(0)


class SlowEmbedding(TinyEmbedding):
    """TinyEmbedding plus ``rounds`` of matrix work per call (not per image), so a batch takes
    a predictable while regardless of its size; the output is unchanged. Served scripted (see
    ``export_slow``): a trace would unroll the loop, and every step of the export and of the
    worker's load would then walk thousands of matrix products."""

    def __init__(self, rounds: int) -> None:
        super().__init__()
        self.rounds = rounds
        self.weight = nn.Parameter(torch.randn(384, 384) / 384**0.5, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Tied to the input so that freezing the model cannot precompute the work.
        state = self.weight + 0.0 * x.mean()
        for _ in range(self.rounds):
            state = torch.tanh(state @ self.weight)
        pooled: torch.Tensor = self.pool(x)
        return pooled.flatten(1) + 0.0 * state.mean()


TIMED_ROUNDS = 20


@functools.cache
def slow_round_s() -> float:
    """Seconds one round of SlowEmbedding takes on this host, measured once per test run: on
    one thread, as the workers the tests start run it (MB_WORKER_THREADS=1), and loaded as
    they load it (scripted, frozen, optimised). The best of five timings: interference from
    other processes only ever slows one down."""
    scripted = torch.jit.script(SlowEmbedding(TIMED_ROUNDS).eval())
    model = torch.jit.optimize_for_inference(torch.jit.freeze(scripted))
    x = torch.rand(1, 3, TINY_INPUT.crop_size, TINY_INPUT.crop_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for _ in range(2):  # the TorchScript executor optimises on its first calls
                model(x)
            timings = []
            for _ in range(5):
                started = time.perf_counter()
                model(x)
                timings.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return min(timings) / TIMED_ROUNDS


def slow_rounds(seconds: float) -> int:
    """The rounds that make one call of SlowEmbedding take ``seconds`` on this host's CPU."""
    return max(1, round(seconds / slow_round_s()))


class PoisonEmbedding(nn.Module):
    """TinyEmbedding that fails the whole call when any image in the batch is pure magenta."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        means = x.mean(dim=(2, 3))
        magenta = (means[:, 0] > 0.99) & (means[:, 1] < 0.01) & (means[:, 2] > 0.99)
        if bool(magenta.any()):
            raise RuntimeError("poison image")
        pooled: torch.Tensor = self.pool(x)
        return pooled.flatten(1)


def tiny_expected_embedding(pixels: np.ndarray) -> np.ndarray:
    """What TinyEmbedding returns for one preprocessed uint8 [32, 32, 3] image."""
    x = pixels.astype(np.float32) / 255.0
    embedding: np.ndarray = x.reshape(4, 8, 4, 8, 3).mean(axis=(1, 3)).transpose(2, 0, 1)
    return embedding.reshape(-1)


def export_test_model(
    out: Path,
    embedding: nn.Module,
    arch: str = "tiny-test",
    runtimes: Collection[str] = (),
    precision: PrecisionRequest | None = None,
    classifier: nn.Module | None = None,
) -> Path:
    """A test store: TorchScript only unless ``runtimes`` asks for more (the tests that lean
    on a test model's timing, the slow one's say, must run it as TorchScript runs it); its
    classifier a random linear layer unless ``classifier`` is given."""
    torch.manual_seed(0)
    split = SplitModel(
        embedding=embedding.eval(),
        classifier=(classifier or nn.Linear(TINY_DIM, 1000)).eval(),
        input=TINY_INPUT,
        embedding_dim=TINY_DIM,
        num_classes=1000,
    )
    export_split(
        split,
        arch=arch,
        weights="random",
        out=out,
        classes=CLASSES,
        runtimes=runtimes,
        precision=precision,
    )
    return out


def export_tiny(out: Path, runtimes: Collection[str] = ()) -> Path:
    return export_test_model(out, TinyEmbedding(), runtimes=runtimes)


def export_scaled(out: Path, scale: float, runtimes: Collection[str] = ()) -> Path:
    """Another version of the tiny model (``arch`` tiny-test): embeddings ``scale`` times."""
    return export_test_model(out, ScaledEmbedding(scale), runtimes=runtimes)


def export_slow(out: Path, seconds: float) -> Path:
    """The slow test model, sized so that one call (a batch of any size) takes ``seconds``
    on one thread of this host's CPU (at least that: a worker that shares its core runs
    slower). Sized by time, not by a count of rounds: a count tuned on one CPU lasted
    several times longer on another, and its test ran into its deadline there."""
    embedding = torch.jit.script(SlowEmbedding(slow_rounds(seconds)).eval())
    return export_test_model(out, embedding, arch="slow-test")


def export_poison(out: Path) -> Path:
    return export_test_model(out, torch.jit.script(PoisonEmbedding()), arch="poison-test")


def export_embedding_only(out: Path) -> Path:
    """TinyEmbedding with no classifier: an embedding-only store."""
    split = SplitModel(
        embedding=TinyEmbedding().eval(),
        classifier=None,
        input=TINY_INPUT,
        embedding_dim=TINY_DIM,
        num_classes=0,
    )
    export_split(split, arch="tiny-backbone", weights="random", out=out, runtimes=())
    return out
