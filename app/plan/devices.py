"""Which devices the workers run on: resolve parsed ``CUDA_DEVICES`` against the GPUs that
exist, and spread workers over them. Pure, except ``count_gpus``, which asks the hardware.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from app.settings_values import AUTO

log = logging.getLogger(__name__)


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


# A GPU driver leaves these behind (NVIDIA; AMD's ROCm): without any, torch can see no GPU.
GPU_DRIVER_PATHS = ("/proc/driver/nvidia/gpus", "/dev/nvidiactl", "/dev/kfd")


def count_gpus() -> int:
    """How many GPUs torch sees here (0 on a machine with no GPU driver).

    Asked of torch in a short-lived child process, so that the process planning the workers
    (the HTTP server, the broker workers' supervisor) never imports torch itself: it would
    hold hundreds of megabytes for the rest of its life to answer one question."""
    if not any(os.path.exists(path) for path in GPU_DRIVER_PATHS):
        return 0
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        answer = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
        )
        return int(answer.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        log.warning("could not count the GPUs (%s): running on CPU", exc)
        return 0
