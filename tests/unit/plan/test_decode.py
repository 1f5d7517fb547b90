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
    ("setting", "devices", "server", "workers", "on_device", "idle_exception"),
    [
        ("auto", CPU2, 8, 3, False, True),  # the server decodes, an idle server's worker too
        ("auto", GPU2, 0, 8, False, False),  # 16 cores / 2 GPU workers
        ("server", CPU2, 8, 0, False, False),
        ("server", GPU2, 8, 0, False, False),
        ("worker", CPU2, 0, 3, False, False),  # a CPU worker's own torch threads
        ("device", CPU2, 0, 3, True, False),
        ("device", GPU2, 0, 8, True, False),
    ],
)
def test_who_decodes(
    setting: str,
    devices: list[str],
    server: int,
    workers: int,
    on_device: bool,
    idle_exception: bool,
) -> None:
    plan = _plan(setting, devices)
    assert (plan.server_threads, plan.worker_threads) == (server, workers)
    assert plan.on_device is on_device
    assert plan.idle_uploads_to_workers is idle_exception
    assert plan.workers_decode is (workers > 0)


def test_mb_decode_threads_sizes_both_sides() -> None:
    plan = _plan("auto", CPU2, decode_threads=5)
    assert (plan.server_threads, plan.worker_threads) == (5, 5)
    assert _plan("server", CPU2, decode_threads=5).worker_threads == 0


@pytest.mark.parametrize(
    ("setting", "devices", "busy", "idle"),
    [
        ("auto", CPU2, True, False),  # busy: decoded here, overlapping the model
        ("server", CPU2, True, True),  # always here
        ("worker", CPU2, False, False),  # never here
        ("auto", GPU2, False, False),
    ],
)
def test_whether_the_server_decodes_an_upload(
    setting: str, devices: list[str], busy: bool, idle: bool
) -> None:
    plan = _plan(setting, devices)
    assert plan.server_decodes(idle=False) is busy
    assert plan.server_decodes(idle=True) is idle


def test_a_plan_where_nobody_decodes_is_refused() -> None:
    with pytest.raises(ValueError, match="somebody must decode"):
        DecodePlan(server_threads=0, worker_threads=0)
    with pytest.raises(ValueError, match="both sides"):
        DecodePlan(server_threads=4, worker_threads=0, idle_uploads_to_workers=True)


def test_the_plan_describes_itself() -> None:
    assert "idle server" in _plan("auto", CPU2).describe()
    assert _plan("device", GPU2).describe().startswith("the workers' device")
    assert _plan("server", CPU2).describe() == "the server (8 threads)"
