from __future__ import annotations

from pathlib import Path

import pytest

from app.plan.devices import assign_workers, resolve_devices
from app.settings_values import parse_cuda_devices


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, None),
        ("auto", None),
        ("AUTO", None),
        ("", []),
        ("  ", []),
        ("cpu", []),
        ("0", [0]),  # GPU 0 is a device, not "false"
        ("0,1,2,3", [0, 1, 2, 3]),
        (" 2 , 0 ", [2, 0]),
    ],
)
def test_parse_cuda_devices(text: str | None, expected: list[int] | None) -> None:
    assert parse_cuda_devices(text) == expected


@pytest.mark.parametrize("text", ["-1", "a", "0,,1", "1.5", "0,0", "cuda:0"])
def test_parse_cuda_devices_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cuda_devices(text)


def test_resolve_devices() -> None:
    assert resolve_devices(None, 0) == ["cpu"]
    assert resolve_devices([0, 1], 0) == ["cpu"]  # no CUDA at all: CPU
    assert resolve_devices(None, 2) == ["cuda:0", "cuda:1"]
    assert resolve_devices([], 2) == ["cpu"]
    assert resolve_devices([0], 4) == ["cuda:0"]
    assert resolve_devices([3, 1], 4) == ["cuda:3", "cuda:1"]
    with pytest.raises(ValueError, match="GPU 2"):
        resolve_devices([0, 2], 2)


def test_assign_workers_round_robin_includes_gpu_0() -> None:
    assert assign_workers(["cuda:0", "cuda:1"], None) == ["cuda:0", "cuda:1"]
    assert assign_workers(["cuda:0", "cuda:1"], 5) == [
        "cuda:0",
        "cuda:1",
        "cuda:0",
        "cuda:1",
        "cuda:0",
    ]
    assert assign_workers(["cpu"], 3) == ["cpu", "cpu", "cpu"]


def test_without_a_gpu_driver_no_gpu_is_counted_and_torch_is_not_asked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from app.plan import devices

    monkeypatch.setattr(devices, "GPU_DRIVER_PATHS", (str(tmp_path / "nvidia"),))
    monkeypatch.setattr("app.plan.devices.subprocess.run", None)  # a probe would fail loudly
    assert devices.count_gpus() == 0
