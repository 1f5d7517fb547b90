"""How a worker compiles its models for the CPU it has."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("threads", "cores", "pinned"), [(2, 2, True), (1, 2, False), (4, 2, True)]
)
def test_openvino_pins_its_threads_only_where_one_worker_holds_every_core(
    threads: int, cores: int, pinned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers that share the cores would be pinned to the same ones."""
    from app.workers.models import pins_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    assert pins_threads(threads) is pinned
