"""MB_DECODE, interpreted once: who decodes, on how many threads."""

from __future__ import annotations

import pytest

from app.plan.decode import DecodePlan, plan_decode

CPU2 = ["cpu", "cpu"]
GPU2 = ["cuda:0", "cuda:1"]


def _plan(setting: str, devices: list[str], decode_threads: int | None = None) -> DecodePlan:
    return plan_decode(
        setting,  # type: ignore[arg-type]
        devices,
        torch_threads=3,
        decode_threads=decode_threads,
        cpu_count=16,
    )


@pytest.mark.parametrize(
    ("setting", "devices", "server", "workers", "on_device"),
    [
        ("auto", CPU2, 0, 3, False),  # the workers decode, on their own torch threads
        ("auto", GPU2, 0, 8, False),  # 16 cores / 2 GPU workers
        ("server", CPU2, 8, 0, False),
        ("server", GPU2, 8, 0, False),
        ("worker", CPU2, 0, 3, False),  # a CPU worker's own torch threads
        ("device", CPU2, 0, 3, True),
        ("device", GPU2, 0, 8, True),
    ],
)
def test_who_decodes(
    setting: str, devices: list[str], server: int, workers: int, on_device: bool
) -> None:
    plan = _plan(setting, devices)
    assert (plan.server_threads, plan.worker_threads) == (server, workers)
    assert plan.on_device is on_device
    assert plan.server_decodes is (server > 0)
    assert plan.workers_decode is (workers > 0)


def test_mb_decode_threads_sizes_the_side_that_decodes() -> None:
    assert _plan("auto", CPU2, decode_threads=5).worker_threads == 5
    assert _plan("server", CPU2, decode_threads=5).server_threads == 5
    assert _plan("server", CPU2, decode_threads=5).worker_threads == 0


def test_a_plan_where_nobody_or_both_decode_is_refused() -> None:
    with pytest.raises(ValueError, match="somebody must decode"):
        DecodePlan(server_threads=0, worker_threads=0)
    with pytest.raises(ValueError, match="one side"):
        DecodePlan(server_threads=4, worker_threads=2)


def test_the_plan_describes_itself() -> None:
    assert _plan("auto", CPU2).describe() == "the workers (3 threads each)"
    assert _plan("device", GPU2).describe().startswith("the workers' device")
    assert _plan("server", CPU2).describe() == "the server (8 threads)"
