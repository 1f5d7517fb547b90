"""Reading weights from files: plain state dicts and the checkpoints training scripts save."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import nn

from app.exporters.base import ExportError
from app.manifest import sha256_file

# Where training scripts keep the model's state dict inside a checkpoint (Lightning and timm's
# train.py: "state_dict"; others: "model", "model_state_dict").
STATE_DICT_KEYS = ("state_dict", "model", "model_state_dict")
DATA_PARALLEL_PREFIX = "module."


def hub_checkpoint(url: str) -> Path:
    """Where torch.hub keeps the checkpoint downloaded from ``url`` (it may not be there)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(url).path).name


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The state dict in ``path`` (a .safetensors file, or a torch.save file): a state dict
    itself, or a checkpoint dict holding one under one of ``STATE_DICT_KEYS``. Loads tensors
    only (``weights_only``: no code runs), and drops the "module." prefix that
    ``nn.DataParallel`` adds."""
    if not path.is_file():
        raise ExportError(f"weights file {path} does not exist")
    try:
        if path.suffix == ".safetensors":  # what the Hugging Face hub serves
            from safetensors.torch import load_file

            state: object = load_file(path, device="cpu")
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ExportError(f"cannot read weights from {path}: {type(exc).__name__}: {exc}") from None
    if isinstance(state, dict):
        for key in STATE_DICT_KEYS:
            if isinstance(state.get(key), dict):
                state = state[key]
                break
    if (
        not isinstance(state, dict)
        or not state
        or not all(isinstance(v, torch.Tensor) for v in state.values())
    ):
        raise ExportError(
            f"{path} does not hold a state dict of tensors (nor one under "
            f"{', '.join(repr(k) for k in STATE_DICT_KEYS)})"
        )
    if all(key.startswith(DATA_PARALLEL_PREFIX) for key in state):
        state = {key.removeprefix(DATA_PARALLEL_PREFIX): value for key, value in state.items()}
    return state


def load_by_order(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load weights whose names differ but whose order and shapes match ``model`` one to one."""
    target = model.state_dict()
    if len(state) != len(target):
        raise ExportError(f"{source} has {len(state)} tensors, the model expects {len(target)}")
    renamed = {}
    for (src_key, tensor), (dst_key, expected) in zip(state.items(), target.items(), strict=True):
        if tensor.shape != expected.shape:
            raise ExportError(
                f"{source}: {src_key} has shape {tuple(tensor.shape)}, "
                f"{dst_key} needs {tuple(expected.shape)}"
            )
        renamed[dst_key] = tensor
    model.load_state_dict(renamed)


def load_strict(model: nn.Module, state: dict[str, torch.Tensor], path: Path, arch: str) -> None:
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise ExportError(f"{path} does not fit {arch}: {exc}") from None


def head_outputs(state: dict[str, torch.Tensor], head: str) -> int:
    """How many outputs the checkpoint's head ``head`` (a module path) has; 0 if it has none."""
    weight = state.get(f"{head}.weight")
    return 0 if weight is None else int(weight.shape[0])


def describe(path: Path) -> str:
    """What the manifest says about weights read from ``path``."""
    return f"file:{path.name} sha256:{sha256_file(path)}"
