"""A worker keeps the memory its batches free: no fresh pages to fault in on every call."""

from __future__ import annotations

import multiprocessing
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from app.lifecycle import ModelSpec
from app.plan import WorkerConfig
from app.workers import allocator, process, serve
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


def run_script(script: str, mode: str, env: dict[str, str] | None = None) -> list[str]:
    """What ``script`` prints, split, run with ``mode`` in a fresh interpreter: malloc's
    settings are process-wide and must not leak into pytest."""
    done = subprocess.run(
        [sys.executable, "-c", script, mode],
        cwd=Path(__file__).resolve().parents[3],  # so that ``app`` imports
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return done.stdout.split()


def page_faults(mode: str) -> int:
    return int(run_script(ROUNDS, mode)[0])


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
    monkeypatch.setattr(process, "read_manifest", fail_to_load)  # the first read of the store
    monkeypatch.setattr(process, "choose_runtime", fail_to_load)
    ours, theirs = multiprocessing.Pipe()
    config = WorkerConfig(max_batch_size=8)
    spec = WorkerSpec(0, "cpu", torch.get_num_threads(), config, "unused", 0)
    serve.worker_main(spec, theirs)  # its buffer does not open: it stops, tuned all the same
    assert isinstance(ours.recv(), StartFailed)
    assert calls == ["allocator"]
    # Its first model loads as any later one does (start-up is a load): after the tuning.
    worker = process.PreparedWorker(config, "cpu", torch.get_num_threads())
    with pytest.raises(process.LoadFailure):
        worker.load(ModelSpec("unused", 1, "unused", "unused@000000000000"))
    assert calls == ["allocator", "allocator", "load_models"]


def _report_malloc(queue: multiprocessing.Queue[tuple[str, str | None, str]]) -> None:
    import os

    import numpy as np
    import openvino as ov

    from app.workers.allocator import malloc_in_use

    # OpenVINO's threading library aborted on jemalloc until its environment said otherwise.
    image = ov.opset13.parameter([1, 3, 8, 8], np.float32)
    model = ov.Model([ov.opset13.relu(image)], [image])
    compiled = ov.Core().compile_model(model, "CPU")
    ran = compiled(np.ones((1, 3, 8, 8), np.float32))[0].shape
    queue.put((malloc_in_use(), os.environ.get("MALLOC_CONF"), str(ran)))


@pytest.mark.skipif(allocator.jemalloc_library() is None, reason="needs libjemalloc2")
@pytest.mark.parametrize("preloaded_by", ["us", "the operator"])
def test_a_worker_process_starts_on_jemalloc_and_runs_openvino(
    preloaded_by: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the pool and the broker supervisor do around each worker's start; an operator
    who preloads jemalloc (or another malloc) themselves keeps theirs, and OpenVINO runs."""
    conf: str | None = allocator.JEMALLOC_CONF
    if preloaded_by == "the operator":
        monkeypatch.setenv("LD_PRELOAD", "libjemalloc.so.2")
        monkeypatch.delenv("MALLOC_CONF", raising=False)
        conf = None
    context = multiprocessing.get_context("spawn")
    queue: multiprocessing.Queue[tuple[str, str | None, str]] = context.Queue()
    child = context.Process(target=_report_malloc, args=(queue,))
    before = dict(os.environ)
    with allocator.for_children():
        child.start()
    assert dict(os.environ) == before  # the parent's own environment is left as it was
    child.join(timeout=60)
    assert child.exitcode == 0  # -6 when OpenVINO's threading aborted
    assert queue.get(timeout=5) == ("jemalloc", conf, "(1, 3, 8, 8)")
    assert allocator.malloc_in_use() == "glibc"  # this process: as it started


def test_an_operators_own_allocator_settings_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "jemalloc_library", lambda: "libjemalloc.so.2")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setenv("MALLOC_CONF", "narenas:2")
    assert allocator.children_environment() == {
        "LD_PRELOAD": "libjemalloc.so.2",
        "MALLOC_CONF": "narenas:2",
        "TBB_ENABLE_SANITIZERS": "1",
    }
    monkeypatch.setenv("LD_PRELOAD", "/opt/libtcmalloc.so")  # another allocator: theirs,
    assert allocator.children_environment() == {"TBB_ENABLE_SANITIZERS": "1"}  # OpenVINO on it
    monkeypatch.setattr(allocator, "jemalloc_library", lambda: None)
    monkeypatch.delenv("LD_PRELOAD")
    assert allocator.children_environment() == {}  # glibc, tuned and bounded in the worker


# Free memory kept inside glibc's heap, as fragmented activations leave it: 400 chunks of
# 1 MiB, touched, each followed by a small allocation that stays, then the chunks freed.
FRAGMENTS = textwrap.dedent(
    """
    import ctypes, sys
    from app.workers import allocator
    mode = sys.argv[1]
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    assert allocator.retain_freed_memory() == (mode == "glibc")
    bound = allocator.ResidentBound(slack=0.03, interval_s=60)
    bound.settle()
    base = allocator.anonymous_bytes()
    chunks, pins = [], []
    for _ in range(400):
        chunk = libc.malloc(1 << 20)
        ctypes.memset(chunk, 1, 1 << 20)
        chunks.append(chunk)
        pins.append(libc.malloc(64))
    for chunk in chunks:
        libc.free(chunk)
    grown = allocator.anonymous_bytes()
    first, second = bound.after_batch(), bound.after_batch()
    print((grown - base) >> 20, (allocator.anonymous_bytes() - base) >> 20, first, second)
    """
)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="bounds glibc's malloc only")
def test_a_glibc_worker_hands_back_free_memory_past_its_level_once_per_interval() -> None:
    on_glibc = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    grown_mb, left_mb, first, second = run_script(FRAGMENTS, "glibc", on_glibc)
    assert int(grown_mb) >= 390  # the freed chunks stayed resident in the heap
    assert int(left_mb) < 50  # handed back
    assert (first, second) == ("True", "False")  # and not again within the interval


@pytest.mark.skipif(allocator.jemalloc_library() is None, reason="needs libjemalloc2")
def test_the_bound_leaves_a_jemalloc_worker_alone() -> None:
    on_jemalloc = {**os.environ, **allocator.children_environment()}
    assert run_script(FRAGMENTS, "jemalloc", on_jemalloc)[2:] == ["False", "False"]
