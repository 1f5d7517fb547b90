"""A worker keeps the memory its batches free: no fresh pages to fault in on every call."""

from __future__ import annotations

import multiprocessing
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from app.plan import WorkerConfig
from app.workers import process
from app.workers.messages import StartFailed, WorkerSpec

# Activation-sized arrays (1-48 MiB) allocated and freed in a mixed order, as batches of
# different sizes do; prints the page faults of five rounds after a warm-up round.
ROUNDS = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    if sys.argv[1] == "tuned":
        from app.workers.allocator import retain_freed_memory
        assert retain_freed_memory()
    def one_round():
        for mib in (1, 8, 2, 32, 4, 48):
            a = np.ones(mib << 18, dtype=np.float32)
            b = a * 2
            del a, b
    one_round()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        one_round()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def page_faults(mode: str) -> int:
    # A fresh interpreter each: the thresholds are process-wide and must not leak into pytest.
    done = subprocess.run(
        [sys.executable, "-c", ROUNDS, mode],
        cwd=Path(__file__).resolve().parents[3],  # so that ``app`` imports
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout.strip())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc's malloc only")
def test_freed_memory_is_reused_instead_of_faulted_in_again() -> None:
    default, tuned = page_faults("default"), page_faults("tuned")
    assert default > 1_000  # glibc's defaults really do unmap and fault in again here
    assert tuned < default / 100


def test_a_worker_tunes_its_allocator_before_anything_else(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []

    def fail_to_load(*args: object, **kwargs: object) -> None:
        calls.append("load_models")
        raise RuntimeError("no model here")

    monkeypatch.setattr(process, "retain_freed_memory", lambda: calls.append("allocator"))
    monkeypatch.setattr(process, "choose_runtime", fail_to_load)
    ours, theirs = multiprocessing.Pipe()
    config = WorkerConfig(model_store="unused", max_batch_size=8)
    spec = WorkerSpec(0, "cpu", torch.get_num_threads(), config, "unused", 0)
    process.worker_main(spec, theirs)
    assert isinstance(ours.recv(), StartFailed)
    assert calls == ["allocator", "load_models"]
