"""What an export records about the models it wrote, beside their checksums: each
TorchScript module's content digest, on the module as saved (``Manifest.content``: the
served id is built from it), and how fast each runtime ran here (``Manifest.speeds``: a
worker serving with a slower runtime than one that failed its self-test on its host says how
much slower by these)."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Literal

import torch

from app.manifest import Content, Manifest, Speeds
from app.workers.content import module_digest
from app.workers.models import LoadOptions, load_models, quiet_torchscript
from app.workers.runtimes import TIMING_BATCH, images_per_s, self_test_images

CPU = torch.device("cpu")


def content_of(out: Path, manifest: Manifest) -> Content:
    """The content digest of each TorchScript module of the store in ``out``."""
    digests: dict[Literal["embedding", "classifier"], str] = {}
    with quiet_torchscript():
        for role in ("embedding", "classifier"):
            entry = manifest.files.get(role)
            if entry is not None:
                path = str(out / entry.path)
                module = torch.jit.load(path, map_location="cpu")  # type: ignore[no-untyped-call]
                digests[role] = module_digest(module)
    return Content(modules=digests)


def cpu_name() -> str:
    """This machine's CPU, as /proc/cpuinfo names it (else the platform's word)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def speeds_of(out: Path, manifest: Manifest) -> Speeds:
    """Images/s of full-task batches of ``TIMING_BATCH`` for TorchScript and each derived
    runtime of the store in ``out``, in fp32, on this CPU's threads."""
    options = LoadOptions(threads=torch.get_num_threads())
    pixels = self_test_images(manifest.input.image_shape, TIMING_BATCH)
    measured = {}
    for runtime in ("torchscript", *manifest.runtimes):
        models = load_models(out, CPU, options, runtime=runtime, manifest=manifest)  # type: ignore[arg-type]
        measured[runtime] = round(images_per_s(models, CPU, pixels), 1)
    return Speeds(images_per_s=measured, batch_size=TIMING_BATCH, cpu=cpu_name())
