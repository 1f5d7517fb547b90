"""Which devices the workers run on: parse ``CUDA_DEVICES`` and spread workers over them.

Parsing is pure (no torch) so settings validation can use it; only ``resolve_devices``
asks torch what hardware exists.
"""

from __future__ import annotations

AUTO = None  # sentinel returned by parse_cuda_devices: "every visible CUDA device"


def parse_cuda_devices(text: str | None) -> list[int] | None:
    """Parse ``CUDA_DEVICES``.

    ``None`` or ``"auto"`` -> ``None`` (all visible CUDA devices, CPU when there are none);
    ``""`` or ``"cpu"`` -> ``[]`` (CPU only); ``"0,2"`` -> ``[0, 2]``. GPU 0 is a device like
    any other. Raises ``ValueError`` for negatives, non-integers and duplicates.

    >>> parse_cuda_devices("0, 1")
    [0, 1]
    """
    if text is None:
        return AUTO
    cleaned = text.strip().lower()
    if cleaned == "auto":
        return AUTO
    if cleaned in ("", "cpu", "none"):
        return []
    ids: list[int] = []
    for part in cleaned.split(","):
        token = part.strip()
        if not token.isdigit():
            raise ValueError(
                f"expected comma-separated GPU indices like '0,1', 'cpu' or 'auto', got {text!r}"
            )
        index = int(token)
        if index in ids:
            raise ValueError(f"GPU {index} is listed twice in {text!r}")
        ids.append(index)
    return ids


def resolve_devices(requested: list[int] | None, available: int) -> list[str]:
    """Turn a parsed request into torch device strings, given ``available`` CUDA devices.

    An empty result never happens: no CUDA means ``["cpu"]``.
    """
    if available == 0:
        return ["cpu"]
    if requested is AUTO:
        return [f"cuda:{i}" for i in range(available)]
    if not requested:
        return ["cpu"]
    missing = [i for i in requested if i >= available]
    if missing:
        raise ValueError(
            f"CUDA_DEVICES asks for GPU {missing[0]} but only {available} CUDA device(s) exist"
        )
    return [f"cuda:{i}" for i in requested]


def assign_workers(devices: list[str], worker_num: int | None) -> list[str]:
    """Spread ``worker_num`` workers round-robin over ``devices`` (default: one per device).

    >>> assign_workers(["cuda:0", "cuda:1"], 4)
    ['cuda:0', 'cuda:1', 'cuda:0', 'cuda:1']
    """
    count = len(devices) if worker_num is None else worker_num
    return [devices[i % len(devices)] for i in range(count)]


def cuda_device_count() -> int:
    """How many CUDA devices torch sees (0 on a CPU-only machine)."""
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
