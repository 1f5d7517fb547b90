"""The export's runtime-neutral record: each model as a ``torch.export`` program (``.pt2``) with
a dynamic batch dimension, written beside the TorchScript files.

TorchScript is deprecated upstream; an ExportedProgram is what its successors take (OpenVINO,
ONNX, Torch-TensorRT and AOTInductor all accept one), so a store that holds one can be
served by a torch without TorchScript. The export keeps a program only if, loaded back, it
reproduces the TorchScript models on the check batch and on a batch of one (an example batch
of one could have fixed the batch size; the check batch has two). A model ``torch.export``
cannot capture (data-dependent control flow, a scripted module) gets a store without
programs, and a warning: TorchScript still serves it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from app.exporters.base import derive_checked
from app.manifest import FileEntry, ProgramArtifact, sha256_file

log = logging.getLogger("app.export")

SUFFIX = ".pt2"
# The most a program's output may differ from the TorchScript model's on the check batch.
TOLERANCE = 1e-4
# The batch sizes a program accepts (torch.export needs a bound; no server batch comes near).
MAX_BATCH = 1 << 16


Programs = dict[str, torch.export.ExportedProgram]


def export_programs(
    out: Path, models: dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]
) -> tuple[ProgramArtifact, Programs] | None:
    """Export each ``role: (eager model, example batch, the TorchScript model's output on it)``
    to ``out/<role>.pt2`` and check it; describe the result and return the programs, or
    return ``None`` (with a warning, and no files left) where any model cannot be exported
    or does not agree."""
    remove_programs(out)
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    programs: Programs = {}

    def export(
        role: str, module: nn.Module, example: torch.Tensor
    ) -> tuple[dict[str, FileEntry], nn.Module]:
        if isinstance(module, torch.jit.ScriptModule):
            raise TypeError(f"the {role} model is TorchScript, which torch.export cannot read")
        path = out / f"{role}{SUFFIX}"
        programs[role] = torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
        torch.export.save(programs[role], str(path))
        entry = FileEntry(path=path.name, sha256=sha256_file(path))
        return {role: entry}, torch.export.load(str(path)).module()

    checked = derive_checked(
        "torch.export program", models, export, TOLERANCE, lambda: remove_programs(out)
    )
    if checked is None:
        return None
    files, worst = checked
    artifact = ProgramArtifact(
        files=files, versions={"torch": torch.__version__}, max_abs_diff=worst
    )
    return artifact, programs


def remove_programs(out: Path) -> None:
    """Remove the programs an earlier export left in ``out`` (the manifest would no longer
    vouch for them)."""
    for path in out.glob(f"*{SUFFIX}"):
        path.unlink()
