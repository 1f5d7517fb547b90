"""Where the workers run and how many threads each gets: decided once, at start-up.

Pure: the number of GPUs and cores comes in as arguments (``cuda_device_count()`` asks torch,
and only the engine calls it), so the rules are tested without hardware.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from app.decode_plan import DecodePlan, DecodeSetting, plan_decode
from app.errors import WorkerStartError
from app.settings import Settings
from app.workers.devices import assign_workers, cuda_device_count, resolve_devices
from app.workers.messages import WorkerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerPlan:
    """One entry of ``devices`` per worker process, the torch threads each runs on, and
    who decodes the uploads.

    >>> plan = plan_workers(cuda_devices=None, worker_num=None, worker_threads=None,
    ...                     decode="auto", decode_threads=None, available_gpus=2, cpu_count=16)
    >>> plan.devices, plan.torch_threads, plan.decode.worker_threads
    (('cuda:0', 'cuda:1'), 1, 8)
    """

    devices: tuple[str, ...]
    torch_threads: int
    decode: DecodePlan

    @property
    def on_cpu(self) -> bool:
        return all(device == "cpu" for device in self.devices)


def plan_workers(
    *,
    cuda_devices: list[int] | None,
    worker_num: int | None,
    worker_threads: int | None,
    decode: DecodeSetting,
    decode_threads: int | None,
    available_gpus: int,
    cpu_count: int,
) -> WorkerPlan:
    """Plan ``worker_num`` workers (``MB_WORKER_NUM``; default one per device) over
    ``cuda_devices`` (parsed ``CUDA_DEVICES``: ``None`` all GPUs, ``[]`` the CPU).

    Threads per worker (``MB_WORKER_THREADS``) default to the cores shared evenly among CPU
    workers, and to 1 for a GPU worker, whose CPU threads only feed its device. Raises
    ``WorkerStartError`` for a GPU that does not exist."""
    try:
        available = resolve_devices(cuda_devices, available_gpus)
    except ValueError as exc:
        raise WorkerStartError(str(exc)) from None
    if cuda_devices and available_gpus == 0:
        log.warning(
            "CUDA_DEVICES=%s but no CUDA device is usable: running on CPU",
            ",".join(map(str, cuda_devices)),
        )
    devices = tuple(assign_workers(available, worker_num))
    if worker_threads is not None:
        threads = worker_threads
    elif all(device == "cpu" for device in devices):
        threads = max(1, cpu_count // len(devices))
    else:
        threads = 1
    return WorkerPlan(
        devices=devices,
        torch_threads=threads,
        decode=plan_decode(
            decode,
            devices,
            torch_threads=threads,
            decode_threads=decode_threads,
            cpu_count=cpu_count,
        ),
    )


def plan_from_settings(settings: Settings, decode: DecodeSetting | None = None) -> WorkerPlan:
    """Devices, threads and decode placement for these settings on this machine
    (``decode`` overrides ``MB_DECODE``)."""
    return plan_workers(
        cuda_devices=settings.cuda_device_ids,
        worker_num=settings.mb_worker_num,
        worker_threads=settings.mb_worker_threads,
        decode=decode or settings.mb_decode,
        decode_threads=settings.mb_decode_threads,
        available_gpus=cuda_device_count(),
        cpu_count=os.cpu_count() or 1,
    )


def worker_config(settings: Settings, plan: WorkerPlan) -> WorkerConfig:
    """What every model worker loads, and how."""
    return WorkerConfig(
        model_store=str(settings.model_store),
        max_batch_size=settings.max_batch_size,
        auto_batch=settings.mb_batch_size == "auto",
        dtype=settings.mb_dtype,
        optimize=settings.mb_optimize,
        decode_threads=plan.decode.worker_threads,
        decode_on_device=plan.decode.on_device,
        max_pixels=settings.max_image_pixels,
        log_level=settings.log_level,
        log_format=settings.log_format,
    )
