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
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from app.batching import Trial
from app.errors import WorkerStartError
from app.images import preprocess
from app.manifest import DTYPES, PRECISION_TAGS, Agreement, Manifest, read_manifest
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
# MIN_COSINE_BELOW_FP32 and the same top-1 class (lower precisions may swap near-ties). An
# imported TorchServe archive below fp32 keeps, besides, fp32's top 5 in order on every image
# (``Manifest.top5_contract``), or as many as its export measured.
MIN_COSINE_FP32 = 0.9999
MIN_COSINE_BELOW_FP32 = 0.99
SLACK_COSINE = 0.01
SELF_TEST_IMAGES = 4
# Real photos (scikit-image's, public domain or CC0, views of them at 256 px): the self-test
# of a store held to its top 5 that saved no golden images of its own.
GOLDEN = sorted((Path(__file__).resolve().parent.parent / "golden").glob("*.jpg"))
TIMING_BATCH = 8
TIMING_ROUNDS = 3
TIMING_MIN_S = 0.1
FAVOURED = 1000.0  # testing only (MB_TEST_FASTEST_DTYPE): how much faster a favoured one times
# MB_DTYPE=auto keeps the precision it would serve in anyway (the one chosen on this host
# class before, else the export's own) unless another measures this many times faster: the
# served id names the precision, and must not flip with the noise of a timing.
DECISIVE = 1.25


@dataclass
class RuntimeChoice:
    """The models a worker serves with, and what the choice saw: each candidate's agreement
    with the reference and images/s at ``TIMING_BATCH`` (those timed), why others were
    skipped, and how many times slower than the fastest skipped runtime the export measured
    the one serving is (None: not slower, or no figures to say)."""

    models: LoadedModels
    dtype: torch.dtype = torch.float32  # what computes: the precision chosen
    trials: dict[str, Trial] = field(default_factory=dict)  # by label: what each showed
    skipped: dict[str, str] = field(default_factory=dict)
    slowdown: float | None = None

    @property
    def images_per_s(self) -> dict[str, float]:
        """The candidates timed, by label."""
        return {k: t.images_per_s for k, t in self.trials.items() if t.images_per_s is not None}

    def describe(self) -> str:
        """The trials in one line: "openvino+bf16: 212.0 images/s, cosine 0.9991, top-1 1.00;
        ..." (what a worker logs when it chose by timing)."""
        parts = []
        for label, trial in self.trials.items():
            figures = [f"{trial.images_per_s:.1f} images/s"] if trial.images_per_s else []
            if trial.cosine_min is not None:
                figures.append(f"cosine {trial.cosine_min:.4f}")
            if trial.top1 is not None:
                figures.append(f"top-1 {trial.top1:.2f}")
            if not trial.passed:
                figures.append("refused")
            parts.append(f"{label}: {', '.join(figures) or 'the reference'}")
        return "; ".join(parts)

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
    fp32 the agreement its export measured on them (None: the fixed thresholds), and whether
    it must keep fp32's top 5 in order there (``Manifest.top5_contract``)."""

    images: npt.NDArray[np.uint8]
    dtype: torch.dtype
    expected: Agreement | None = None
    keep_top5: bool = False
    what: str = "synthetic self-test images"

    @classmethod
    def for_store(cls, store: Path, manifest: Manifest, dtype: torch.dtype) -> SelfTest:
        """The store's golden images (real photos) where its export saved some, else
        synthetic ones (for an imported archive, the photos shipped in ``app/golden``: its
        top 5 are held to real photos, which synthetic ones let bf16 pass too easily); the
        export's measured agreement where it measured this ``dtype``."""
        calibration = manifest.calibration
        keep_top5 = manifest.top5_contract
        if calibration is None and keep_top5:
            photos = np.stack([preprocess(p.read_bytes(), manifest.input) for p in GOLDEN])
            return cls(photos, dtype, keep_top5=True, what="golden photos (app/golden)")
        if calibration is None:
            return cls(self_test_images(manifest.input.image_shape), dtype)
        images = np.load(store / calibration.golden.path, allow_pickle=False)
        same = DTYPES[calibration.precision] == str(dtype).removeprefix("torch.")
        expected = calibration.golden_agreement if same else None
        return cls(images, dtype, expected, keep_top5, "golden images")

    def failure(self, measured: Agreement) -> str | None:
        """Why ``measured`` does not pass; None if it does."""
        one_image = 1.0 / measured.images
        if self.dtype == torch.float32:
            if measured.cosine_min < MIN_COSINE_FP32:
                return f"embedding cosine {measured.cosine_min:.6f} < {MIN_COSINE_FP32}"
            if measured.top5 is not None and measured.top5 < 1.0:
                return "top-5 classes differ from TorchScript's"
            return None
        if self.keep_top5 and measured.top5_same is not None:
            expected = self.expected.top5_same if self.expected is not None else None
            least = 1.0 if expected is None else expected
            if measured.top5_same < least - 1e-9:
                changed = round((1 - measured.top5_same) * measured.images)
                return (
                    f"top 5 not fp32's, in order, on {changed} of {measured.images} {self.what}: "
                    "an imported TorchServe archive serves below fp32 only where it keeps them"
                )
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


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 or AMX): where it does not,
    OpenVINO and torch emulate bf16, slower than fp32, so a worker never tries it there."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def candidate_dtypes(
    manifest: Manifest, setting: str, device: torch.device, bf16_units: bool | None = None
) -> list[str]:
    """The precisions a worker may serve ``manifest``'s store in under ``MB_DTYPE=setting``,
    the first being the one it falls back to: ``auto`` on an fp32 export, on a CPU with bf16
    units (``bf16_units``; None: this CPU's), fp32 and bf16, the faster that passes its gate
    serving; an export made for a precision, that one; any other setting, itself."""
    if setting != "auto":
        return [setting]
    exported = manifest.serving_dtype("auto")
    if exported != "float32" or device.type != "cpu":
        return [exported]
    has_bf16 = cpu_has_bf16() if bf16_units is None else bf16_units
    return ["float32", "bfloat16"] if has_bf16 else ["float32"]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _label(runtime: str, dtype: torch.dtype, home: torch.dtype) -> str:
    """A candidate's name: its runtime, and its precision unless it is the home one."""
    if dtype == home:
        return runtime
    return f"{runtime}+{PRECISION_TAGS[str(dtype).removeprefix('torch.')].lstrip('+')}"


def choose_runtime(
    store: Path,
    device: torch.device,
    options: LoadOptions,
    setting: RuntimeSetting,
    manifest: Manifest | None = None,
    dtypes: Sequence[torch.dtype] = (),
    bf16_units: bool = False,
    favoured: torch.dtype | None = None,
    incumbent: torch.dtype | None = None,
) -> RuntimeChoice:
    """The models to serve ``store`` with on ``device`` under ``MB_RUNTIME=setting``: in
    ``options.dtype``, or, given ``dtypes`` (``candidate_dtypes``: MB_DTYPE=auto), in the
    fastest of them that passes its gate (the first being the one to fall back to). With
    ``bf16_units``, an int8 model's layers left in float are tried in bf16 too.
    ``manifest``: the store's, already read and verified by the caller. Among the
    precisions, the fastest serves only if it is ``DECISIVE``ly faster than ``incumbent``
    (the one chosen on this host class before, with a log line when it changes) or, without
    one, than the first of ``dtypes``. ``favoured`` (testing only, ``MB_TEST_FASTEST_DTYPE``):
    candidates in that precision are timed a thousand times faster than measured."""
    dtypes = list(dtypes) or [options.dtype]
    home = dtypes[0]
    manifest = manifest or read_manifest(store)  # every file verified once, for every load
    if setting == "torchscript" and torch.int8 in dtypes:
        raise WorkerStartError("MB_RUNTIME=torchscript cannot serve int8: set MB_RUNTIME=auto")
    held: Sequence[Runtime] = list(manifest.runtimes)
    if setting != "auto" and setting != "torchscript" and setting not in held:
        int8 = " in int8" if torch.int8 in dtypes else ""
        raise WorkerStartError(
            f"MB_RUNTIME={setting}, but {store} holds no {setting} models{int8}: re-export "
            "it with `python -m app.export` (with openvino installed), or set MB_RUNTIME=auto"
        )
    candidates: list[tuple[Runtime, torch.dtype, bool]] = []  # and: int8's floats in bf16
    for dtype in dtypes:
        if dtype == torch.int8:
            runtimes: list[Runtime] = ["openvino"] if manifest.int8_files else []
        else:
            runtimes = ["torchscript", *held]
            if dtype != torch.float32:  # AOTInductor packages compute in float32 only
                runtimes = [name for name in runtimes if name != "aoti"]
        for name in runtimes:
            if setting in ("auto", name):
                candidates.append((name, dtype, False))
                if dtype == torch.int8 and bf16_units:
                    candidates.append((name, dtype, True))
    if torch.int8 in dtypes and not candidates:
        raise WorkerStartError(
            f"MB_DTYPE=int8, but {store} holds no int8 models: export it with `python -m "
            "app.export --precision int8 --calibrate DIR`, or set MB_DTYPE=float32"
        )
    if device.type != "cpu":
        derived = [name for name, _, _ in candidates if name != "torchscript"]
        if setting not in ("auto", "torchscript") or torch.int8 in dtypes:
            raise WorkerStartError(
                f"MB_RUNTIME={derived[0] if derived else setting} runs on the CPU only, "
                f"not on {device}"
            )
        on_device = load_models(store, device, replace(options, dtype=home), manifest=manifest)
        return RuntimeChoice(on_device, dtype=home, skipped={n: f"not on {device}" for n in held})
    # TorchScript fp32 is the reference every candidate is gated against, and the fallback
    # (int8 aside: TorchScript has no int8 models, and an int8 store serves int8 or nothing).
    fp32 = load_models(store, device, replace(options, dtype=torch.float32), manifest=manifest)
    passing: list[tuple[str, LoadedModels, torch.dtype]] = []
    skipped: dict[str, str] = {}
    trials: dict[str, Trial] = {}
    for name, dtype, bf16_floats in candidates:
        label = _label(name, dtype, home) + ("+bf16" if bf16_floats else "")
        if name == "torchscript" and dtype == torch.float32:
            passing.append((label, fp32, dtype))  # the reference itself
            trials[label] = Trial(label, passed=True)
            continue
        test = SelfTest.for_store(store, manifest, dtype)
        try:
            candidate = replace(options, dtype=dtype, bf16_floats=bf16_floats)
            models = load_models(store, device, candidate, runtime=name, manifest=manifest)
            measured = measure(fp32, models, test.images)
            reason = test.failure(measured)
            trials[label] = Trial(label, reason is None, measured.cosine_min, measured.top1)
        except Exception as exc:  # a crash in a runtime must not stop a worker that has another
            reason = f"{type(exc).__name__}: {exc}"
            trials[label] = Trial(label, passed=False)
        if reason is None:
            passing.append((label, models, dtype))
            continue
        if ((setting != "auto" and dtype == home) or dtype == torch.int8) and not bf16_floats:
            in_int8 = torch.int8 in dtypes
            raise WorkerStartError(
                f"MB_RUNTIME={name}{' (int8)' if in_int8 else ''} failed its self-test here: "
                f"{reason}{'; serve this store in fp32 with MB_DTYPE=float32' if in_int8 else ''}"
            )
        log.warning("%s skipped on this host: %s", label, reason[:300])
        skipped[label] = reason
    if not passing:
        raise WorkerStartError(
            f"no runtime passes its self-test in {str(home).removeprefix('torch.')} here: "
            f"{'; '.join(f'{label}: {why[:200]}' for label, why in skipped.items())}; serve "
            "this store in fp32 with MB_DTYPE=float32"
        )
    if len(passing) == 1 or (setting != "auto" and len(dtypes) == 1):
        label, models, dtype = passing[0]
        return RuntimeChoice(models, dtype, trials, skipped).judge(manifest)
    timing = self_test_images(manifest.input.image_shape, TIMING_BATCH)
    for label, models, dtype in passing:
        rate = images_per_s(models, device, timing) * (FAVOURED if dtype == favoured else 1)
        trials[label] = replace(trials[label], images_per_s=rate)
    choice = RuntimeChoice(fp32, torch.float32, trials, skipped)
    rates = choice.images_per_s
    dtype_of = {label: dtype for label, _, dtype in passing}
    fastest = max(rates, key=lambda label: rates[label])
    kept = incumbent if incumbent in dtype_of.values() else home
    best_kept = max((lb for lb in rates if dtype_of[lb] == kept), key=lambda lb: rates[lb])
    chosen = fastest if rates[fastest] >= DECISIVE * rates[best_kept] else best_kept
    if incumbent is not None and dtype_of[chosen] != incumbent:
        why = (
            f"measured {rates[chosen] / rates[best_kept]:.2f}x as fast as"
            if incumbent == kept
            else "passes its self-test here, and not"
        )
        log.warning(
            "%s: %s %s %s, chosen on this host class before: serving in %s from now on",
            manifest.model_id,
            _dtype_name(dtype_of[chosen]),
            why,
            _dtype_name(incumbent),
            _dtype_name(dtype_of[chosen]),
        )
    _, choice.models, choice.dtype = next(c for c in passing if c[0] == chosen)
    return choice.judge(manifest)
