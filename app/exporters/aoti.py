"""Deriving AOTInductor packages from an export's ``torch.export`` programs: each model
compiled ahead of time to native code for this CPU (``aoti/<role>.pt2``).

A package is machine code: it runs only on a CPU with the instruction set it was compiled
for (an AVX-512 package can die of SIGILL on an AVX2 host), against the exact torch that
built it. So the manifest records what it was built for (``RuntimeArtifact.built_for``: the
vector ISA, and the thread count, dynamic here: the package follows the worker's
``torch.set_num_threads``), and a worker refuses, with a clear message, a package whose key
does not match its host (``app.workers.models``). Compiling needs a C++ compiler; without
one the export says so and writes no package. Kept only if it reproduces the TorchScript
models on the check batch and on one image.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
from pathlib import Path

import torch

from app.exporters.base import derive_checked
from app.manifest import FileEntry, RuntimeArtifact, sha256_file
from app.workers.models import LOADERS, LoadOptions, Model

log = logging.getLogger("app.export")

FOLDER = "aoti"
TOLERANCE = 1e-3  # the most a package's output may differ from TorchScript's on the check batch
# Compiled with the thread count left to run time, and frozen weights (constant folding).
INDUCTOR_CONFIGS = {"cpp.dynamic_threads": True, "freezing": True}


def compiler() -> str | None:
    """The C++ compiler inductor would use ($CXX, else g++), if installed."""
    return shutil.which(os.environ.get("CXX", "g++"))


def host_isa() -> str:
    """The vector instruction set inductor compiles for on this host (e.g. ``avx512``)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return str(pick_vec_isa())


def derive_aoti(
    out: Path, models: dict[str, tuple[torch.export.ExportedProgram, torch.Tensor, torch.Tensor]]
) -> RuntimeArtifact | None:
    """Compile each ``role: (program, example batch, the TorchScript model's output on it)``
    into ``out/aoti/<role>.pt2``, check it, and describe the result; ``None`` (with a
    warning, and no files left) without a compiler or a program, or where it disagrees."""
    remove_aoti(out)
    if compiler() is None:
        log.warning("no C++ compiler (g++, or $CXX): no AOTInductor package for this export")
        return None
    if not models:
        log.warning("no torch.export programs to compile: no AOTInductor package")
        return None
    from torch._inductor import aoti_compile_and_package

    folder = out / FOLDER
    folder.mkdir()

    def compile_package(
        role: str, program: torch.export.ExportedProgram, example: torch.Tensor
    ) -> tuple[dict[str, FileEntry], Model]:
        path = folder / f"{role}.pt2"
        configs = dict(INDUCTOR_CONFIGS)
        aoti_compile_and_package(program, package_path=str(path), inductor_configs=configs)
        entry = FileEntry(path=f"{FOLDER}/{path.name}", sha256=sha256_file(path))
        return {role: entry}, LOADERS["aoti"](path, torch.device("cpu"), LoadOptions())

    checked = derive_checked(
        "AOTInductor package", models, compile_package, TOLERANCE, lambda: remove_aoti(out)
    )
    if checked is None:
        return None
    files, worst = checked
    return RuntimeArtifact(
        files=files,
        versions={"torch": torch.__version__},
        built_for={"machine": platform.machine(), "isa": host_isa(), "threads": "dynamic"},
        max_abs_diff=worst,
        source="program",
    )


def remove_aoti(out: Path) -> None:
    """Remove ``out``'s AOTInductor packages, if any."""
    shutil.rmtree(out / FOLDER, ignore_errors=True)
