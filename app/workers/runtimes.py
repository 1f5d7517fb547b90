"""Which runtime a worker serves with (``MB_RUNTIME``), chosen on its own host at start-up.

TorchScript, which every store holds, is the reference. Each other runtime the store holds
models for (``Manifest.runtimes``) is loaded and must pass a self-test against it on the
same inputs (the same top-5 classes; embeddings within cosine ``MIN_COSINE``); with
``auto``, those that pass are timed with the reference, the way ``MB_BATCH_SIZE=auto`` times
batch sizes, and the fastest serves. A runtime that fails to load or to agree (OpenVINO is
not officially supported on every CPU) is skipped with one log line; asked for by name, it
stops the worker's start instead. Measured figures: docs/performance.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from app.errors import WorkerStartError
from app.plan.serving import RuntimeSetting
from app.workers.models import LoadedModels, LoadOptions, Runtime, load_models
from app.workers.runner import BatchRunner

log = logging.getLogger("app.worker")

# Agreement with the fp32 TorchScript reference that a runtime must show to serve: every
# self-test embedding this close (cosine), and the same top-5 classes (in fp32; top-1 in a
# lower precision, whose near-ties may swap).
MIN_COSINE = {torch.float32: 0.9999, torch.bfloat16: 0.99, torch.float16: 0.99}
SELF_TEST_IMAGES = 4
TIMING_BATCH = 8
TIMING_ROUNDS = 3
TIMING_MIN_S = 0.1


@dataclass
class RuntimeChoice:
    """The models a worker serves with, and what the choice saw: images/s by runtime at
    ``TIMING_BATCH`` (those timed), and why others were skipped."""

    models: LoadedModels
    images_per_s: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def self_test_images(
    shape: tuple[int, int, int], count: int = SELF_TEST_IMAGES
) -> npt.NDArray[np.uint8]:
    """Deterministic uint8 images with structure (gradients, stripes) and noise, so the
    models' outputs are spread out rather than near ties."""
    height, width, _ = shape
    rng = np.random.default_rng(20261125)
    y, x = np.mgrid[0:height, 0:width]
    images = []
    for i in range(count):
        base = np.stack(
            [(x * (i + 1) * 3) % 256, (y * (i + 2) * 2) % 256, ((x + y) * (i + 1)) % 256], axis=-1
        )
        noise = rng.integers(0, 64, size=(height, width, 3))
        images.append(np.clip(base + noise, 0, 255).astype(np.uint8))
    return np.stack(images)


def disagreement(
    reference: LoadedModels,
    candidate: LoadedModels,
    pixels: npt.NDArray[np.uint8],
    dtype: torch.dtype,
) -> str | None:
    """Why ``candidate`` does not agree with ``reference`` on ``pixels``; None if it does."""
    device = torch.device("cpu")
    ref, got = BatchRunner(reference, device), BatchRunner(candidate, device)
    with torch.inference_mode():
        ref_features = reference.embedding(ref.to_input(pixels)).float()
        features = candidate.embedding(got.to_input(pixels)).float()
        if features.shape != ref_features.shape:
            return f"embedding shape {tuple(features.shape)}, expected {tuple(ref_features.shape)}"
        cosine = float(torch.nn.functional.cosine_similarity(features, ref_features).min())
        if not cosine >= MIN_COSINE[dtype]:
            return f"embedding cosine {cosine:.6f} < {MIN_COSINE[dtype]}"
        if reference.classifier is None or candidate.classifier is None:
            return None
        k = min(5 if dtype == torch.float32 else 1, reference.manifest.num_classes)
        expected = torch.topk(reference.classifier(ref_features.to(reference.dtype)).float(), k)
        top = torch.topk(candidate.classifier(features.to(candidate.dtype)).float(), k)
        if not torch.equal(expected.indices, top.indices):
            return f"top-{k} classes differ from TorchScript's"
    return None


def images_per_s(
    models: LoadedModels, device: torch.device, pixels: npt.NDArray[np.uint8]
) -> float:
    """Best images/s over ``TIMING_ROUNDS`` rounds of back-to-back full-task calls (workers
    measure at the same time and share the cores: interference only slows a timing)."""
    runner = BatchRunner(models, device)
    runner.run(runner.full_task, pixels, 1)  # the first call at a shape may be slower
    best = 0.0
    for _ in range(TIMING_ROUNDS):
        calls, started = 0, time.perf_counter()
        while calls < 1 or time.perf_counter() - started < TIMING_MIN_S:
            runner.run(runner.full_task, pixels, 1)
            calls += 1
        best = max(best, len(pixels) * calls / (time.perf_counter() - started))
    return best


def choose_runtime(
    store: Path, device: torch.device, options: LoadOptions, setting: RuntimeSetting
) -> RuntimeChoice:
    """The models to serve ``store`` with on ``device`` under ``MB_RUNTIME=setting``."""
    reference = load_models(store, device, options)
    if setting == "torchscript":
        return RuntimeChoice(reference)
    held: Sequence[Runtime] = list(reference.manifest.runtimes)
    if setting != "auto" and setting not in held:
        raise WorkerStartError(
            f"MB_RUNTIME={setting}, but {store} holds no {setting} models: re-export it with "
            "`python -m app.export` (with openvino installed), or set MB_RUNTIME=auto"
        )
    candidates = held if setting == "auto" else [setting]
    if device.type != "cpu":
        if setting != "auto":
            raise WorkerStartError(f"MB_RUNTIME={setting} runs on the CPU only, not on {device}")
        return RuntimeChoice(reference, skipped={name: f"not on {device}" for name in held})
    choice = RuntimeChoice(reference)
    # The agreement is checked against the fp32 reference, whatever MB_DTYPE asks.
    fp32 = reference
    if options.dtype != torch.float32:
        fp32 = load_models(store, device, LoadOptions(threads=options.threads))
    checks = self_test_images(reference.manifest.input.image_shape)
    passing: list[LoadedModels] = []
    for name in candidates:
        try:
            models = load_models(store, device, options, runtime=name)
            reason = disagreement(fp32, models, checks, options.dtype)
        except Exception as exc:  # a crash in a runtime must not stop a worker that has another
            reason = f"{type(exc).__name__}: {exc}"
        if reason is not None:
            if setting != "auto":
                raise WorkerStartError(f"MB_RUNTIME={name} failed its self-test here: {reason}")
            log.warning("runtime %s skipped on this host: %s", name, reason[:300])
            choice.skipped[name] = reason
            continue
        passing.append(models)
    if setting != "auto":
        choice.models = passing[0]
        return choice
    if not passing:
        return choice
    timing = np.concatenate([checks] * (TIMING_BATCH // len(checks) + 1))[:TIMING_BATCH]
    for models in [reference, *passing]:
        choice.images_per_s[models.runtime] = images_per_s(models, device, timing)
    fastest = max(choice.images_per_s, key=lambda name: choice.images_per_s[name])
    choice.models = next(m for m in [reference, *passing] if m.runtime == fastest)
    return choice
