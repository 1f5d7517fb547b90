"""Only CPU workers idle for a while lend their threads to a batch."""

from __future__ import annotations

from dataclasses import dataclass

from app.workers.lending import LEND_AFTER_IDLE_S, batch_threads

NOW = 1000.0


@dataclass
class FakeWorker:
    device: str = "cpu"
    threads: int = 2
    serving: bool = True
    idle_since: float = NOW


def _idle_for(seconds: float, **fields: object) -> FakeWorker:
    return FakeWorker(idle_since=NOW - seconds, **fields)  # type: ignore[arg-type]


def test_only_workers_idle_for_a_while_lend_their_threads() -> None:
    runner = FakeWorker()
    long_idle = 10 * LEND_AFTER_IDLE_S

    def threads(*others: FakeWorker) -> int:
        return batch_threads(runner, [runner, *others], NOW)

    assert threads(_idle_for(long_idle)) == 4
    assert threads(_idle_for(long_idle), _idle_for(long_idle, threads=3)) == 7
    assert threads(_idle_for(LEND_AFTER_IDLE_S)) == 4  # exactly long enough
    # Idle only between two batches (under load), busy, or a GPU worker: nothing to lend.
    assert threads(_idle_for(0.0)) == 2
    assert threads(_idle_for(long_idle, serving=False)) == 2
    assert threads(_idle_for(long_idle, device="cuda:0")) == 2


def test_a_gpu_worker_keeps_its_threads_as_they_are() -> None:
    assert batch_threads(FakeWorker(device="cuda:1"), [_idle_for(1.0)], NOW) == 0
