"""Loading exported models: one small interface so formats other than TorchScript
(``torch.export`` programs, say) can be added behind it."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from app.manifest import Manifest, read_manifest

Model = Callable[[torch.Tensor], torch.Tensor]

# TorchScript is deprecated upstream (torch >= 2.11) and warns on every save/load/trace; the
# format still works and is what we ship, so keep those warnings away from users.
TORCHSCRIPT_DEPRECATION = r"`torch\.jit\.\w+` is deprecated"


@contextmanager
def quiet_torchscript() -> Iterator[None]:
    """Hide TorchScript's deprecation warnings (and nothing else) inside the block."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TORCHSCRIPT_DEPRECATION, category=FutureWarning)
        yield


@dataclass
class LoadedModels:
    manifest: Manifest
    embedding: Model
    classifier: Model | None  # None: an embedding-only export
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class LoadOptions:
    """How a worker prepares the models it loads."""

    dtype: torch.dtype = torch.float32
    # Freeze and optimise for inference (constant folding, conv+batchnorm fusion, oneDNN
    # layouts on CPU): much faster small batches on a CPU (docs/performance.md).
    optimize: bool = True


def _load_torchscript(path: Path, device: torch.device, options: LoadOptions) -> Model:
    with quiet_torchscript():
        module = torch.jit.load(str(path), map_location=device)  # type: ignore[no-untyped-call]
        module.eval()
        if options.dtype != torch.float32:
            module = module.to(options.dtype)
        if options.optimize:
            module = torch.jit.optimize_for_inference(torch.jit.freeze(module))
    return module  # type: ignore[no-any-return]


LOADERS: dict[str, Callable[[Path, torch.device, LoadOptions], Model]] = {
    "torchscript": _load_torchscript
}


def load_models(
    store: Path, device: torch.device, options: LoadOptions | None = None
) -> LoadedModels:
    """Verify ``store`` against its manifest, then load its models (the embedding model, and
    the classifier head unless the export has none) onto ``device``."""
    options = options or LoadOptions()
    manifest = read_manifest(store, verify=True)
    load = LOADERS[manifest.format]
    return LoadedModels(
        manifest=manifest,
        embedding=load(store / manifest.files["embedding"].path, device, options),
        classifier=(
            load(store / manifest.files["classifier"].path, device, options)
            if manifest.has_classifier
            else None
        ),
        dtype=options.dtype,
    )
