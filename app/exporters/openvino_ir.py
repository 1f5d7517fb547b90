"""Deriving the OpenVINO IR of an export: its ``torch.export`` programs (or, for a model that
has none, its TorchScript traces), converted at export time.

IR is data (an XML graph and a weights file), not code: a worker that loads it runs nothing
the export did not check. The export keeps an IR only if it reproduces the TorchScript
models on the check batch; a host where OpenVINO cannot convert or run gets a store without
one (and a warning), which serves with TorchScript.
"""

from __future__ import annotations

import logging
import platform
from functools import partial
from pathlib import Path

import torch

from app.exporters.base import derive_checked
from app.manifest import FileEntry, RuntimeArtifact, sha256_file
from app.workers.models import Model, openvino_core, quiet_torchscript

log = logging.getLogger("app.export")

FOLDER = "openvino"
# The most an fp32 IR output may differ from the TorchScript model's on the check batch.
FP32_TOLERANCE = 1e-3


Source = torch.export.ExportedProgram | torch.jit.ScriptModule


def _convert(source: Source, example: torch.Tensor, path: Path) -> None:
    import openvino as ov

    shape = [ov.PartialShape([-1, *example.shape[1:]])]  # dynamic batch, the rest fixed
    if isinstance(source, torch.export.ExportedProgram):
        model = ov.convert_model(source, input=shape)
    else:
        with quiet_torchscript():
            model = ov.convert_model(source, example_input=example, input=shape)
    # Weights stay fp32 (save_model would compress them to fp16 by default).
    ov.save_model(model, str(path), compress_to_fp16=False)


def _run(path: Path, x: torch.Tensor) -> torch.Tensor:
    compiled = openvino_core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return torch.from_numpy(compiled(x.numpy())[0].copy())


def derive_openvino(
    out: Path,
    models: dict[str, tuple[Source, torch.Tensor, torch.Tensor]],
) -> RuntimeArtifact | None:
    """Convert each ``role: (program or traced model, example input, the TorchScript
    model's output on it)`` into
    ``out/openvino/<role>.xml`` (+ ``.bin``), check the IR against the TorchScript output on
    batches of 1 and of the example's size, and describe the result; ``None`` (with a
    warning, and no files left) where OpenVINO is missing or its IR does not agree."""
    folder = out / FOLDER
    try:
        import openvino as ov
    except ImportError:
        log.warning("openvino is not installed: the export holds TorchScript only")
        return None
    _remove(folder)  # an earlier export's IR (a classifier this one may not have)
    folder.mkdir()

    def convert(
        role: str, source: Source, example: torch.Tensor
    ) -> tuple[dict[str, FileEntry], Model]:
        xml = folder / f"{role}.xml"
        _convert(source, example, xml)
        files = {
            key: FileEntry(path=f"{FOLDER}/{file.name}", sha256=sha256_file(file))
            for key, file in ((role, xml), (f"{role}.bin", xml.with_suffix(".bin")))
        }
        return files, partial(_run, xml)

    checked = derive_checked(
        "OpenVINO IR", models, convert, FP32_TOLERANCE, lambda: _remove(folder)
    )
    if checked is None:
        return None
    files, worst = checked
    versions = {"openvino": ov.__version__.split("-")[0], "torch": torch.__version__}
    versions["machine"] = platform.machine()
    programs = all(
        isinstance(source, torch.export.ExportedProgram) for source, _, _ in models.values()
    )
    source = "program" if programs else "torchscript"
    return RuntimeArtifact(files=files, versions=versions, max_abs_diff=worst, source=source)


def remove_derived(out: Path) -> None:
    """Remove ``out``'s OpenVINO folder, if any."""
    _remove(out / FOLDER)


def _remove(folder: Path) -> None:
    if not folder.is_dir():
        return
    for file in folder.glob("*"):
        file.unlink()
    folder.rmdir()
