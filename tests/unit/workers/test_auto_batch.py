"""MB_BATCH_SIZE=auto: the knee of measured throughput, with a fake clock (deterministic)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from app.jobs import Task
from app.workers.runner import choose_batch_size

# The clock the runner reads, patched by dotted name (app.workers.runner does not re-export
# the time module it imports).
PERF_COUNTER = "app.workers.runner.time.perf_counter"


class FakeRunner:
    """Each call 'takes' cost(batch size) seconds on a fake clock."""

    full_task = Task.TAG

    def __init__(self, cost: Any) -> None:
        self.cost = cost
        self.now = 0.0
        self.sizes: list[int] = []

    def clock(self) -> float:
        return self.now

    def run(self, task: Task, pixels: np.ndarray, top_k: int) -> dict[str, Any]:
        self.sizes.append(len(pixels))
        self.now += self.cost(len(pixels))
        return {}


@pytest.mark.parametrize(
    ("cost", "upper", "expected"),
    [
        (lambda n: 0.010 * n, 64, 1),  # per-image cost flat (CPU-like): batch 1 is as good
        (lambda n: 0.010 + 0.001 * n, 64, 64),  # fixed overhead dominates (GPU-like): grow
        (lambda n: 0.02 + 0.002 * n, 8, 8),  # capped by the upper bound
        (lambda n: 0.010 * n * (1.5 if n >= 16 else 1.0), 64, 1),  # big batches get slower
        (lambda n: 0.08 if n <= 8 else 0.01 * n, 64, 8),  # plateau from 8 on: take its start
    ],
)
def test_knee(monkeypatch: pytest.MonkeyPatch, cost: Any, upper: int, expected: int) -> None:
    runner = FakeRunner(cost)
    monkeypatch.setattr(PERF_COUNTER, runner.clock)
    chosen, table = choose_batch_size(runner, (4, 4, 3), upper)  # type: ignore[arg-type]
    best = max(table.values())
    assert chosen == expected, table
    assert table[chosen] >= 0.95 * best
    assert max(table) <= upper


def test_stops_growing_once_a_call_is_too_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = FakeRunner(lambda n: 0.3 * n)  # batch 4 takes 1.2 s a call
    monkeypatch.setattr(PERF_COUNTER, runner.clock)
    chosen, table = choose_batch_size(runner, (4, 4, 3), 64)  # type: ignore[arg-type]
    assert max(table) == 4 and 8 not in runner.sizes
    assert chosen == 1


def test_a_timing_slowed_by_a_neighbour_does_not_decide(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch 4 is the knee, but another worker happened to share the cores while batch 4 was
    first timed (three times slower): the later rounds time it again and it still wins."""
    first_calls_at_4 = iter(range(3))  # the warm-up call and the first timing

    def cost(n: int) -> float:
        per_image = 0.010 if n < 4 else 0.006
        slowed = n == 4 and next(first_calls_at_4, None) is not None
        return n * per_image * (3.0 if slowed else 1.0)

    runner = FakeRunner(cost)
    monkeypatch.setattr(PERF_COUNTER, runner.clock)
    chosen, table = choose_batch_size(runner, (4, 4, 3), 16)  # type: ignore[arg-type]
    assert chosen == 4, table
    assert table[4] == pytest.approx(4 / (4 * 0.006))


def test_stops_growing_once_throughput_falls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sizes in a row under the knee: bigger batches are not tried (start-up time)."""
    runner = FakeRunner(lambda n: 0.010 * n * (1.0 if n <= 2 else 1.3))
    monkeypatch.setattr(PERF_COUNTER, runner.clock)
    chosen, table = choose_batch_size(runner, (4, 4, 3), 64)  # type: ignore[arg-type]
    assert chosen == 1
    assert sorted(table) == [1, 2, 4, 8] and 16 not in runner.sizes
