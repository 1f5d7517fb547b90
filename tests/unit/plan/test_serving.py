"""The serving plan: where the workers run, how many threads each gets, who decodes, in
process or broker mode, decided once at start-up."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from app.errors import WorkerStartError
from app.plan import Placement, Role, WorkerConfig, plan_serving, plan_workers
from app.settings import Settings
from app.workers.pool import COMMON_IMAGE_SHAPE, ENCODED_BYTES_PER_IMAGE, buffer_bytes


def _plan(gpus: int, **options: Any) -> Placement:
    arguments: dict[str, Any] = {
        "cuda_devices": None,
        "worker_num": None,
        "worker_threads": None,
        "decode": "auto",
        "decode_threads": None,
        "gpus": gpus,
        "cpu_count": 16,
    }
    return plan_workers(**(arguments | options))


def test_cpu_workers_share_the_cores() -> None:
    plan = _plan(0, worker_num=4)
    assert plan.devices == ("cpu",) * 4 and plan.threads == 4 and plan.on_cpu


def test_gpu_workers_spread_round_robin_gpu_0_included() -> None:
    plan = _plan(2, worker_num=3)
    assert plan.devices == ("cuda:0", "cuda:1", "cuda:0")
    assert plan.threads == 1 and not plan.on_cpu


def test_explicit_threads_and_devices_win() -> None:
    plan = _plan(4, cuda_devices=[0, 3], worker_threads=3)
    assert plan.devices == ("cuda:0", "cuda:3") and plan.threads == 3


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
    assert _plan(0).decode.worker_threads and not _plan(0).decode.server_decodes  # auto on CPU
    assert _plan(2).decode.server_threads == 0  # auto on GPUs: the workers decode
    assert _plan(2, worker_num=4).decode.worker_threads == 4  # 16 cores / 4 workers


def test_a_worker_buffer_holds_a_full_batch_of_the_largest_model() -> None:
    """At least a batch of common 224x224 images (a model loaded later fits), more for the
    largest model's; with the workers decoding, room for typical encoded uploads too."""
    config = WorkerConfig(max_batch_size=8)
    common = 8 * int(np.prod(COMMON_IMAGE_SHAPE))
    assert buffer_bytes(config, [(32, 32, 3)]) == common
    assert buffer_bytes(config, [(32, 32, 3), (512, 512, 3)]) == 8 * 512 * 512 * 3
    decoding = WorkerConfig(max_batch_size=8, decode_threads=2)
    assert buffer_bytes(decoding, [(32, 32, 3)]) >= 8 * ENCODED_BYTES_PER_IMAGE


def test_the_plan_of_a_server_holds_every_decision() -> None:
    settings = Settings(
        cuda_devices="cpu", mb_worker_num=2, mb_batch_size="auto", mb_decode="worker"
    )
    plan = plan_serving(settings, gpus=0, cpu_count=4)
    assert plan.role is Role.SERVER and not plan.remote_workers and plan.broker is None
    assert plan.placement.devices == ("cpu", "cpu") and plan.placement.threads == 2
    assert plan.worker.auto_batch and plan.worker.max_batch_size == settings.mb_auto_batch_max
    assert plan.worker.decode_threads == plan.decode.worker_threads == 2
    assert plan.limits.max_queue == settings.mb_max_queue
    assert "2 worker(s) on cpu" in plan.describe()


def test_a_front_end_plans_no_workers_and_never_decodes() -> None:
    settings = Settings(mb_broker="redis://:secret@redis.example:6380/0", mb_decode="server")
    plan = plan_serving(settings, gpus=4, cpu_count=4)
    assert plan.role is Role.FRONT_END and plan.remote_workers
    assert plan.placement.devices == () and plan.decode.server_threads == 0
    assert plan.broker is not None and plan.broker.address == "redis://redis.example:6380"
    assert "secret" not in repr(plan) and "secret" not in plan.describe()


@pytest.mark.parametrize(
    ("setting", "on_device"), [("server", False), ("auto", False), ("device", True)]
)
def test_broker_workers_always_decode(setting: str, on_device: bool) -> None:
    settings = Settings(mb_broker="redis://h:6379/0", mb_decode=setting, mb_worker_name="box")
    plan = plan_serving(settings, Role.WORKERS, gpus=0, cpu_count=2)
    assert plan.decode.server_threads == 0 and plan.decode.worker_threads > 0
    assert plan.decode.on_device is on_device and plan.worker.decode_on_device is on_device
    assert plan.broker is not None and plan.broker.host_name == "box"


def test_broker_workers_without_a_broker_are_refused() -> None:
    with pytest.raises(WorkerStartError, match="MB_BROKER"):
        plan_serving(Settings(), Role.WORKERS, gpus=0, cpu_count=2)
