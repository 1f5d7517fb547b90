"""Exporting for a precision below fp32 (``--precision bf16|int8 --calibrate DIR``).

int8: the OpenVINO embedding model is quantized with nncf on the user's own images (the
classifier head stays fp32: it is a thousandth of the work). Every ``HOLD_BACK_EVERY``-th
image, in name order, is held back from calibration, and the quantized model is measured
against the fp32 TorchScript models on those: top-1 agreement, top-5 overlap and embedding
cosine (``Agreement``). Below the gate the store is not made int8 (the fp32 export stays)
unless the user accepts the loss. bf16 needs no calibration: with ``--calibrate`` its
agreement is measured on all the images the same way. The first held-back images are saved
with the store (``golden.npy``) with what they measured: each worker reproduces that on its
own host before it serves in that precision (``app.workers.runtimes``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from app.errors import ClientError
from app.exporters.base import ExportError
from app.images import preprocess
from app.manifest import (
    INT8_SUFFIX,
    Agreement,
    Calibration,
    FileEntry,
    Gate,
    InputSpec,
    Manifest,
    Precision,
    RuntimeArtifact,
    RuntimeName,
    sha256_file,
)
from app.workers.agreement import measure
from app.workers.models import LoadedModels, LoadOptions, Runtime, load_models, openvino_core

log = logging.getLogger("app.export")

MIN_CALIBRATION_IMAGES = 100  # int8: fewer calibrate (and measure) too poorly to trust
HOLD_BACK_EVERY = 5  # every 5th image is measured on, never calibrated with
GOLDEN_IMAGES = 16  # held-back images kept for the workers' self-test
GOLDEN_FILE = "golden.npy"
GATES: dict[str, Gate] = {
    "int8": Gate(top1=0.97, cosine_mean=0.98),
    "bf16": Gate(top1=0.99, cosine_mean=0.99),
}
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
CPU = torch.device("cpu")


def gate_for(manifest: Manifest, precision: str) -> Gate:
    """The gate ``manifest``'s export is held to in ``precision``: ``GATES``', and every
    held-back image's top 5 kept in order where the export answers its top 5 as they are
    (``Manifest.top5_contract``: an imported TorchServe archive)."""
    gate = GATES[precision]
    return gate.model_copy(update={"top5_same": 1.0}) if manifest.top5_contract else gate


@dataclass(frozen=True)
class PrecisionRequest:
    """What ``--precision``, ``--calibrate`` and ``--accept-accuracy-loss`` ask for."""

    precision: Precision = "fp32"
    calibrate: Path | None = None
    accept_accuracy_loss: bool = False
    gate: Gate | None = None  # None: GATES[precision]

    def __post_init__(self) -> None:
        if self.precision == "int8" and self.calibrate is None:
            raise ExportError(
                "--precision int8 needs --calibrate DIR: at least "
                f"{MIN_CALIBRATION_IMAGES} of your own images, like the ones you will serve"
            )
        if self.precision == "fp32" and self.calibrate is not None:
            raise ExportError("--calibrate is for --precision int8 or bf16")

    @property
    def minimum_images(self) -> int:
        return MIN_CALIBRATION_IMAGES if self.precision == "int8" else HOLD_BACK_EVERY

    def read_images(self, spec: InputSpec) -> npt.NDArray[np.uint8] | None:
        """The calibration images, preprocessed as the server would (None: none asked for).
        Unreadable files are skipped with a warning; too few is an ExportError."""
        if self.calibrate is None:
            return None
        if not self.calibrate.is_dir():
            raise ExportError(f"--calibrate {self.calibrate}: not a directory")
        files = sorted(
            path
            for path in self.calibrate.rglob("*")
            if path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES
        )
        pixels = []
        for path in files:
            try:
                pixels.append(preprocess(path.read_bytes(), spec))
            except (ClientError, OSError) as exc:
                log.warning("calibration: %s skipped: %s", path, exc)
        if len(pixels) < self.minimum_images:
            raise ExportError(
                f"--calibrate {self.calibrate} has {len(pixels)} readable images; "
                f"--precision {self.precision} needs at least {self.minimum_images} "
                f"({', '.join(sorted(IMAGE_SUFFIXES))})"
            )
        return np.stack(pixels)


def _normaliser(models: LoadedModels) -> Callable[[npt.NDArray[np.uint8]], np.ndarray]:
    from app.workers.runner import BatchRunner

    runner = BatchRunner(models, CPU)
    return lambda pixels: runner.to_input(pixels).contiguous().numpy()


# What int8 quantization tries, in turn, until one passes the gate: nncf's defaults (fast
# bias correction); then the first convolution kept fp32 (it sees the normalised pixels,
# whose one per-tensor range fits them worst); then the depthwise convolutions too. Measured
# on EfficientNet-Lite0 (docs/performance.md): the first two run about 2.5x OpenVINO fp32,
# the third 1.35x. nncf's accuracy control was tried as well: it reached the gate by
# reverting so many layers that it ran at fp32's speed.
QUANTIZATIONS: tuple[tuple[str, frozenset[str]], ...] = (
    ("nncf defaults", frozenset()),
    ("first convolution kept fp32", frozenset({"first"})),
    ("first and depthwise convolutions kept fp32", frozenset({"first", "depthwise"})),
)


def _quantize(source: Path, target: Path, inputs: list[np.ndarray], kept: frozenset[str]) -> str:
    """Quantize the OpenVINO model at ``source`` to int8 on ``inputs`` (one normalised image
    each) into ``target``, keeping the ``kept`` layers of one of ``QUANTIZATIONS`` fp32;
    nncf's version."""
    try:
        import nncf
        import openvino as ov
    except ImportError as exc:
        raise ExportError(f"--precision int8 needs nncf and openvino: {exc}") from None
    logging.getLogger("nncf").setLevel(logging.WARNING)  # not every layer's decision
    model = openvino_core().read_model(str(source))
    convolutions = [op for op in model.get_ordered_ops() if op.get_type_name() == "Convolution"]
    names = [convolutions[0].get_friendly_name()] if "first" in kept and convolutions else []
    types = ["GroupConvolution"] if "depthwise" in kept else []
    scope = nncf.IgnoredScope(names=names, types=types, validate=False) if kept else None
    quantized = nncf.quantize(
        model, nncf.Dataset(inputs), subset_size=len(inputs), ignored_scope=scope
    )
    ov.save_model(quantized, str(target), compress_to_fp16=False)
    return str(nncf.__version__)


def _entry(out: Path, path: Path) -> FileEntry:
    return FileEntry(path=str(path.relative_to(out)), sha256=sha256_file(path))


@dataclass
class _Tried:
    """One way of making the precision, measured."""

    method: str
    models: LoadedModels
    agreement: Agreement
    failures: list[str]


def _int8_tries(
    out: Path, manifest: Manifest, fp32: LoadedModels, pixels: npt.NDArray[np.uint8], gate: Gate
) -> Iterator[_Tried]:
    """Each of ``QUANTIZATIONS`` in turn, quantized into ``out`` (the same files: the last
    one tried is the one there) and measured on the held-back ``pixels``."""
    openvino = manifest.runtimes.get("openvino")
    if openvino is None:
        raise ExportError(
            "--precision int8 quantizes the OpenVINO models, and this export has none (is "
            "openvino installed?)"
        )
    held = _held_back(len(pixels))
    normalise = _normaliser(fp32)
    inputs = [normalise(pixels[i : i + 1]) for i in np.flatnonzero(~held)]
    source, target = out / openvino.files["embedding"].path, _int8_model(out, openvino)
    options = LoadOptions(dtype=torch.int8, threads=torch.get_num_threads())
    for name, settings in QUANTIZATIONS:
        version = _quantize(source, target, inputs, settings)
        # Loaded as a worker loads it, from the manifest that will list it.
        quantized = manifest.model_copy(update={"runtimes": _with_int8_files(out, manifest)})
        models = load_models(out, CPU, options, "openvino", manifest=quantized)
        agreement = measure(fp32, models, pixels[held])
        method = f"nncf {version} post-training quantization ({name})"
        yield _Tried(method, models, agreement, gate.failures(agreement))


def _int8_model(out: Path, openvino: RuntimeArtifact) -> Path:
    """Where the int8 embedding model goes: beside the fp32 one."""
    return (out / openvino.files["embedding"].path).with_name(f"embedding{INT8_SUFFIX}.xml")


def _with_int8_files(out: Path, manifest: Manifest) -> dict[RuntimeName, RuntimeArtifact]:
    """``manifest``'s runtimes, its OpenVINO models listing the int8 files written."""
    openvino = manifest.runtimes["openvino"]
    xml = _int8_model(out, openvino)
    role = f"embedding{INT8_SUFFIX}"
    files = openvino.files | {
        role: _entry(out, xml),
        f"{role}.bin": _entry(out, xml.with_suffix(".bin")),
    }
    return manifest.runtimes | {"openvino": openvino.model_copy(update={"files": files})}


def _held_back(count: int) -> npt.NDArray[np.bool_]:
    held: npt.NDArray[np.bool_] = np.arange(count) % HOLD_BACK_EVERY == HOLD_BACK_EVERY - 1
    return held


def lower_precision(
    out: Path, manifest: Manifest, request: PrecisionRequest, pixels: npt.NDArray[np.uint8] | None
) -> Manifest:
    """The fp32 export in ``out`` (``manifest``, written) made ``request.precision``: its
    int8 models (int8), its measured agreement where there are ``pixels``. ExportError,
    leaving the fp32 store as it was, when the agreement falls below the gate (unless the
    request accepts the loss)."""
    update: dict[str, object] = {"precision": request.precision}
    if pixels is None:  # bf16 with nothing to measure on: the workers' self-test is the check
        return manifest.model_copy(update=update)
    fp32 = load_models(out, CPU, LoadOptions(threads=torch.get_num_threads()))
    gate = request.gate or gate_for(manifest, request.precision)
    if request.precision == "bf16":
        measured_on, calibrated = pixels, 0
        runtime: Runtime = "openvino" if "openvino" in manifest.runtimes else "torchscript"
        options = LoadOptions(dtype=torch.bfloat16, threads=torch.get_num_threads())
        models = load_models(out, CPU, options, runtime)
        agreement = measure(fp32, models, pixels)
        tried = _Tried(f"{runtime} bf16", models, agreement, gate.failures(agreement))
        _report(tried, gate, calibrated)
    else:
        held = _held_back(len(pixels))
        measured_on, calibrated = pixels[held], int((~held).sum())
        for tried in _int8_tries(out, manifest, fp32, pixels, gate):
            _report(tried, gate, calibrated)
            if not tried.failures:
                break  # else the last try stays: its files are the ones written
        update["runtimes"] = tried.models.manifest.runtimes  # listing the int8 files kept
    golden_path = out / GOLDEN_FILE
    if tried.failures and not request.accept_accuracy_loss:
        for path in (golden_path, *out.glob(f"*/embedding{INT8_SUFFIX}.*")):
            path.unlink(missing_ok=True)
        raise ExportError(
            f"--precision {request.precision} refused: {'; '.join(tried.failures)} on "
            f"{tried.agreement.images} held-back images. The store stays fp32. Calibrate with "
            "more images like the ones you serve, or pass --accept-accuracy-loss to keep it "
            "anyway"
        )
    golden = measured_on[:GOLDEN_IMAGES]
    np.save(golden_path, golden, allow_pickle=False)
    update["calibration"] = Calibration(
        precision=request.precision,
        runtime=tried.models.runtime,
        method=tried.method,
        calibration_images=calibrated,
        held_back=tried.agreement,
        gate=gate,
        passed=not tried.failures,
        golden=_entry(out, golden_path),
        golden_agreement=measure(fp32, tried.models, golden),
    )
    return manifest.model_copy(update=update)


def _report(tried: _Tried, gate: Gate, calibrated: int) -> None:
    def share(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    agreement = tried.agreement
    log.info(
        "%s, against fp32 on %d held-back images (%d calibrated with): top-1 agreement %s "
        "(gate %s), top-5 overlap %s, top 5 the same in order %s%s, embedding cosine mean "
        "%.4f (gate %s), min %.4f%s",
        tried.method,
        agreement.images,
        calibrated,
        share(agreement.top1),
        gate.top1,
        share(agreement.top5),
        share(agreement.top5_same),
        f" (gate {gate.top5_same})" if gate.top5_same is not None else "",
        agreement.cosine_mean,
        gate.cosine_mean,
        agreement.cosine_min,
        f": below the gate ({'; '.join(tried.failures)})" if tried.failures else "",
    )
