"""Where the workers run and how many threads each gets, decided once at start-up."""

from __future__ import annotations

from typing import Any

import pytest

from app.errors import WorkerStartError
from app.workers.messages import WorkerConfig
from app.workers.plan import WorkerPlan, plan_workers
from app.workers.pool import ENCODED_BYTES_PER_IMAGE, buffer_bytes


def _plan(gpus: int, **options: Any) -> WorkerPlan:
    arguments: dict[str, Any] = {
        "cuda_devices": None,
        "worker_num": None,
        "worker_threads": None,
        "decode": "auto",
        "decode_threads": None,
        "available_gpus": gpus,
        "cpu_count": 16,
    }
    return plan_workers(**(arguments | options))


def test_cpu_workers_share_the_cores() -> None:
    plan = _plan(0, worker_num=4)
    assert plan.devices == ("cpu",) * 4 and plan.torch_threads == 4 and plan.on_cpu


def test_gpu_workers_spread_round_robin_gpu_0_included() -> None:
    plan = _plan(2, worker_num=3)
    assert plan.devices == ("cuda:0", "cuda:1", "cuda:0")
    assert plan.torch_threads == 1 and not plan.on_cpu


def test_explicit_threads_and_devices_win() -> None:
    plan = _plan(4, cuda_devices=[0, 3], worker_threads=3)
    assert plan.devices == ("cuda:0", "cuda:3") and plan.torch_threads == 3


def test_gpus_asked_for_but_none_usable_fall_back_to_the_cpu(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plan = _plan(0, cuda_devices=[0])
    assert plan.devices == ("cpu",)
    assert "no CUDA device is usable" in caplog.text


def test_a_gpu_that_does_not_exist_stops_the_start() -> None:
    with pytest.raises(WorkerStartError, match="GPU 2"):
        _plan(2, cuda_devices=[2])


def test_the_decode_plan_follows_the_devices() -> None:
    assert _plan(0).decode.idle_uploads_to_workers  # auto on CPU
    assert _plan(2).decode.server_threads == 0  # auto on GPUs: the workers decode
    assert _plan(2, worker_num=4).decode.worker_threads == 4  # 16 cores / 4 workers


def test_a_worker_that_decodes_gets_room_for_encoded_uploads() -> None:
    shape = (32, 32, 3)
    pixels_only = WorkerConfig("unused", max_batch_size=8)
    decoding = WorkerConfig("unused", max_batch_size=8, decode_threads=2)
    assert buffer_bytes(pixels_only, shape) == 8 * 32 * 32 * 3
    assert buffer_bytes(decoding, shape) == 8 * ENCODED_BYTES_PER_IMAGE
