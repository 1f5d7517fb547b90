"""Which runtime a worker serves with (``MB_RUNTIME``), chosen on its own host at start-up.

TorchScript in fp32, which every store holds, is the reference. Each other runtime the
store holds models for (``Manifest.runtimes``) is loaded in the precision served (MB_DTYPE)
and must pass a self-test against it on the same images (``SelfTest``: the store's golden
photos where its export saved some); with ``auto``, those that pass are timed with
TorchScript, the way ``MB_BATCH_SIZE=auto`` times batch sizes, and the fastest serves. A
runtime that fails to load or to agree (OpenVINO is not officially supported on every CPU)
is skipped with one log line; asked for by name, it stops the worker's start instead. int8
has no TorchScript to fall back on: its runtime failing stops the start, saying so.
Measured figures: docs/performance.md.
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
from app.manifest import DTYPES, Agreement, Manifest, read_manifest
from app.plan.serving import RuntimeSetting
from app.workers.agreement import measure
from app.workers.models import LoadedModels, LoadOptions, Runtime, load_models
from app.workers.runner import BatchRunner

log = logging.getLogger("app.worker")

# Agreement with the fp32 TorchScript reference that a runtime must show to serve, on the
# self-test images (``Agreement``). In fp32: every embedding this close (cosine) and the same
# top-5 classes. Below fp32, on a store whose export measured that precision on its golden
# images: what the export measured, less SLACK_COSINE and one image's top-1 (the host's
# instruction set may round differently); on any other store: embeddings within
# MIN_COSINE_BELOW_FP32 and the same top-1 class (lower precisions may swap near-ties).
MIN_COSINE_FP32 = 0.9999
MIN_COSINE_BELOW_FP32 = 0.99
SLACK_COSINE = 0.01
SELF_TEST_IMAGES = 4
TIMING_BATCH = 8
TIMING_ROUNDS = 3
TIMING_MIN_S = 0.1


@dataclass
class RuntimeChoice:
    """The models a worker serves with, and what the choice saw: images/s by runtime at
    ``TIMING_BATCH`` (those timed), why others were skipped, and how many times slower than
    the fastest skipped runtime the export measured the one serving is (None: not slower,
    or no figures to say)."""

    models: LoadedModels
    images_per_s: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    slowdown: float | None = None

    def judge(self, manifest: Manifest) -> RuntimeChoice:
        """Set ``slowdown`` from the speeds the export measured (``Manifest.speeds``), and
        say in one WARNING when a runtime that failed here would have served faster."""
        if not self.skipped:
            return self
        serving = self.models.runtime
        speeds = manifest.speeds.images_per_s if manifest.speeds is not None else {}
        faster = {n: speeds[n] for n in self.skipped if speeds.get(n, 0) > speeds.get(serving, 0)}
        if faster and speeds.get(serving):
            best = max(faster, key=lambda name: faster[name])
            self.slowdown = round(faster[best] / speeds[serving], 2)
            log.warning(
                "serving with %s, %.1fx slower than %s (as the export measured them on %s): "
                "%s failed here: %s",
                serving,
                self.slowdown,
                best,
                manifest.speeds.cpu if manifest.speeds is not None else "its host",
                best,
                self.skipped[best][:300],
            )
        elif not speeds:
            log.warning(
                "serving with %s: %s failed here (%s); the export measured no speeds to say "
                "how much slower that is",
                serving,
                ", ".join(self.skipped),
                "; ".join(reason[:200] for reason in self.skipped.values()),
            )
        return self


def self_test_images(
    shape: tuple[int, int, int], count: int = SELF_TEST_IMAGES
) -> npt.NDArray[np.uint8]:
    """Deterministic uint8 images with structure (gradients, stripes) and noise, so the
    models' outputs are spread out rather than near ties: the self-test of a store that
    holds no golden images of its own."""
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


@dataclass(frozen=True)
class SelfTest:
    """What a runtime is checked on in one precision: the images, and for a precision below
    fp32 the agreement its export measured on them (None: the fixed thresholds)."""

    images: npt.NDArray[np.uint8]
    dtype: torch.dtype
    expected: Agreement | None = None

    @classmethod
    def for_store(cls, store: Path, manifest: Manifest, dtype: torch.dtype) -> SelfTest:
        """The store's golden images (real photos) where its export saved some, else
        synthetic ones; the export's measured agreement where it measured this ``dtype``."""
        calibration = manifest.calibration
        if calibration is None:
            return cls(self_test_images(manifest.input.image_shape), dtype)
        images = np.load(store / calibration.golden.path, allow_pickle=False)
        same = DTYPES[calibration.precision] == str(dtype).removeprefix("torch.")
        return cls(images, dtype, calibration.golden_agreement if same else None)

    def failure(self, measured: Agreement) -> str | None:
        """Why ``measured`` does not pass; None if it does."""
        one_image = 1.0 / measured.images
        if self.dtype == torch.float32:
            if measured.cosine_min < MIN_COSINE_FP32:
                return f"embedding cosine {measured.cosine_min:.6f} < {MIN_COSINE_FP32}"
            if measured.top5 is not None and measured.top5 < 1.0:
                return "top-5 classes differ from TorchScript's"
            return None
        if self.expected is not None:
            least = self.expected.cosine_mean - SLACK_COSINE
            if measured.cosine_mean < least:
                return f"mean embedding cosine {measured.cosine_mean:.4f} < {least:.4f}"
            top1, expected = measured.top1, self.expected.top1
            if top1 is not None and expected is not None and top1 < expected - one_image - 1e-9:
                return f"top-1 agreement {top1:.3f}, the export measured {expected:.3f}"
            return None
        if measured.cosine_min < MIN_COSINE_BELOW_FP32:
            return f"embedding cosine {measured.cosine_min:.6f} < {MIN_COSINE_BELOW_FP32}"
        if measured.top1 is not None and measured.top1 < 1.0:
            return "top-1 classes differ from TorchScript's"
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
    store: Path,
    device: torch.device,
    options: LoadOptions,
    setting: RuntimeSetting,
    manifest: Manifest | None = None,
) -> RuntimeChoice:
    """The models to serve ``store`` with on ``device`` under ``MB_RUNTIME=setting``, in
    ``options.dtype``. ``manifest``: the store's, already read and verified by the caller."""
    int8 = options.dtype == torch.int8
    manifest = manifest or read_manifest(store)  # every file verified once, for every load
    # TorchScript has every model but int8 ones; it is the reference, and the fallback.
    reference = None if int8 else load_models(store, device, options, manifest=manifest)
    if setting == "torchscript":
        if reference is None:
            raise WorkerStartError("MB_RUNTIME=torchscript cannot serve int8: set MB_RUNTIME=auto")
        return RuntimeChoice(reference)
    held: Sequence[Runtime] = list(manifest.runtimes)
    if int8:
        held = ["openvino"] if manifest.int8_files else []
    elif options.dtype != torch.float32:  # AOTInductor packages compute in float32 only
        held = [name for name in held if name != "aoti"]
    if setting != "auto" and setting not in held:
        raise WorkerStartError(
            f"MB_RUNTIME={setting}, but {store} holds no {setting} models"
            f"{' in int8' if int8 else ''}: re-export it with `python -m app.export` (with "
            "openvino installed), or set MB_RUNTIME=auto"
        )
    candidates = held if setting == "auto" else [setting]
    if int8 and not candidates:
        raise WorkerStartError(
            f"MB_DTYPE=int8, but {store} holds no int8 models: export it with `python -m "
            "app.export --precision int8 --calibrate DIR`, or set MB_DTYPE=float32"
        )
    if device.type != "cpu":
        if setting != "auto" or reference is None:
            raise WorkerStartError(
                f"MB_RUNTIME={candidates[0]}{' (int8)' if int8 else ''} runs on the CPU only, "
                f"not on {device}"
            )
        return RuntimeChoice(reference, skipped={name: f"not on {device}" for name in held})
    # The agreement is checked against the fp32 reference, whatever MB_DTYPE asks.
    fp32 = reference
    if options.dtype != torch.float32 or fp32 is None:
        fp32 = load_models(store, device, LoadOptions(threads=options.threads), manifest=manifest)
    test = SelfTest.for_store(store, manifest, options.dtype)
    passing: list[LoadedModels] = []
    skipped: dict[str, str] = {}
    for name in candidates:
        try:
            models = load_models(store, device, options, runtime=name, manifest=manifest)
            reason = test.failure(measure(fp32, models, test.images))
        except Exception as exc:  # a crash in a runtime must not stop a worker that has another
            reason = f"{type(exc).__name__}: {exc}"
        if reason is not None:
            if setting != "auto" or reference is None:
                raise WorkerStartError(
                    f"MB_RUNTIME={name}{' (int8)' if int8 else ''} failed its self-test here: "
                    f"{reason}{'; serve this store in fp32 with MB_DTYPE=float32' if int8 else ''}"
                )
            log.warning("runtime %s skipped on this host: %s", name, reason[:300])
            skipped[name] = reason
            continue
        passing.append(models)
    if reference is None or setting != "auto":
        return RuntimeChoice(passing[0])
    choice = RuntimeChoice(reference, skipped=skipped)
    if not passing:
        return choice.judge(manifest)
    timing = np.concatenate([test.images] * (TIMING_BATCH // len(test.images) + 1))
    for models in [reference, *passing]:
        choice.images_per_s[models.runtime] = images_per_s(models, device, timing[:TIMING_BATCH])
    fastest = max(choice.images_per_s, key=lambda name: choice.images_per_s[name])
    choice.models = next(m for m in [reference, *passing] if m.runtime == fastest)
    return choice.judge(manifest)
