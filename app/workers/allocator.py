"""The memory allocator of a worker process: keep the memory batches free, for speed, without
letting it fragment over a long run.

A network's activations are large allocations made and freed on every call. An allocator
that hands them back to the kernel makes each call fault in and zero fresh pages (glibc's
defaults: 3,700 faults per batch-1 EfficientNet-Lite0 call; mixed batch sizes 35-46 against
62-90 img/s). An allocator that keeps them must not fragment: each new batch shape (batch
size, thread count) makes the runtime compile and keep something (oneDNN's primitives under
TorchScript), small long-lived allocations. glibc's heap places them inside the free memory
the last activations left, the next large activation no longer fits, and the heap grows
while the memory in use stays flat (+100% to +200% within 100 batches of 1-32 images).
jemalloc's size classes keep long-lived small allocations apart from large ones, so with
its page decay off (freed pages kept, ``JEMALLOC_CONF``) it is both fast and flat.

So workers run on jemalloc when the machine has it (Debian's ``libjemalloc2``; the image
installs it): ``for_children`` puts it in ``LD_PRELOAD`` for the worker processes a parent
starts. Where it is missing they fall back on glibc's malloc, tuned to keep freed memory
(``retain_freed_memory``), with ``ResidentBound`` handing the free pages back whenever the
worker's memory grows past its warmed-up level, at most every ``TRIM_INTERVAL_S``: bounded,
at the cost of faulting pages in again after each handback. Figures: ``docs/performance.md``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import math
import os
import platform
import time
from collections.abc import Iterator
from typing import Literal

log = logging.getLogger(__name__)

# jemalloc's options for workers: never purge freed pages (as glibc's heap is tuned below);
# an operator's own MALLOC_CONF wins.
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"

# mallopt(3) parameters, from <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# Requests below this come from the heap, whose freed chunks are reused: room for a batch-32
# activation of the bench models with a wide margin. mallopt takes a C int, so < 2 GiB.
MMAP_THRESHOLD_BYTES = 512 << 20
# Give memory back only when this much sits free at the top of the heap.
TRIM_THRESHOLD_BYTES = 1 << 30
# ResidentBound: how far above its warmed-up level a worker's anonymous memory may grow
# before the free part is handed back, and how often at most.
RESIDENT_SLACK = 0.03
TRIM_INTERVAL_S = 5.0


Malloc = Literal["jemalloc", "glibc", "other"]


def jemalloc_library() -> str | None:
    """The name of this machine's jemalloc shared library, if it has one."""
    return ctypes.util.find_library("jemalloc")


def malloc_in_use() -> Malloc:
    """Which malloc this process runs on."""
    this = ctypes.CDLL(None)
    if hasattr(this, "mallctl"):  # jemalloc's own entry point, found first when preloaded
        return "jemalloc"
    return "glibc" if platform.libc_ver()[0] == "glibc" else "other"


def children_environment() -> dict[str, str]:
    """What a worker process's environment needs to run on jemalloc: nothing if this machine
    has none; if ``LD_PRELOAD`` already names an allocator (an operator's), only what lets
    OpenVINO run on it."""
    # oneTBB (OpenVINO's threading) opens its hwloc binding with RTLD_DEEPBIND, so hwloc frees
    # with glibc what libc allocated with the preloaded malloc, and aborts; this switch (meant
    # for sanitizers, which replace malloc too) opens it without. oneTBB issue 1636.
    tbb = {"TBB_ENABLE_SANITIZERS": os.environ.get("TBB_ENABLE_SANITIZERS", "1")}
    library = jemalloc_library()
    preload = os.environ.get("LD_PRELOAD", "")
    if "malloc" in preload:
        return tbb
    if library is None:
        return {}
    return {
        "LD_PRELOAD": f"{library} {preload}".strip(),
        "MALLOC_CONF": os.environ.get("MALLOC_CONF", JEMALLOC_CONF),
        **tbb,
    }


_warned = False


@contextlib.contextmanager
def for_children() -> Iterator[None]:
    """Around starting a worker process: the process starts on jemalloc (it inherits this
    environment at its start; the parent's own allocator is already chosen)."""
    global _warned
    extra = children_environment()
    if not extra and jemalloc_library() is None and not _warned:
        _warned = True
        log.warning(
            "jemalloc is not installed (Debian: libjemalloc2): workers use glibc's malloc, "
            "whose kept memory fragments as batch sizes vary; it is handed back every few "
            "seconds, at some cost in speed"
        )
    saved = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def _glibc() -> ctypes.CDLL | None:
    return ctypes.CDLL(None) if malloc_in_use() == "glibc" else None


def retain_freed_memory() -> bool:
    """Tune glibc's malloc in this process so freed memory is reused, not unmapped. Returns
    whether it applied (False off glibc's malloc: jemalloc is tuned by its environment).
    Call it once, early, in a worker process."""
    libc = _glibc()
    if libc is None:
        return False
    applied = bool(
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    if not applied:
        log.warning("glibc refused the malloc thresholds; batches will fault in fresh pages")
    return applied


# jemalloc's MALLCTL_ARENAS_ALL: "every arena" in an ``arena.<i>.purge`` name.
_ALL_ARENAS = 4096


def release_freed_memory() -> None:
    """Hand every freed page back to the kernel now (a model was unloaded, or one was just
    loaded and is being measured): the workers' allocator keeps freed pages on purpose (see
    the module's docstring), so without this an unloaded model's memory would stay
    resident. Python's garbage first, so the runtimes' objects are really freed; the caller
    must hold no reference to what it unloaded (its memory is kept otherwise)."""
    import gc

    gc.collect()
    this = ctypes.CDLL(None)
    if hasattr(this, "mallctl"):
        this.mallctl(f"arena.{_ALL_ARENAS}.purge".encode(), None, None, None, 0)
    elif malloc_in_use() == "glibc":
        this.malloc_trim(0)


def anonymous_bytes() -> int:
    """This process's resident memory that is neither file-backed nor shared (Linux's
    ``statm``: resident minus shared pages): what malloc holds, not the model files mapped
    or a shared input buffer."""
    with open("/proc/self/statm", "rb") as statm:
        fields = statm.read().split()
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")


class ResidentBound:
    """Keeps a worker on glibc's malloc within ``slack`` of its anonymous memory once warmed
    up, by handing the heap's free pages back to the kernel when it grows past that, at most
    every ``interval_s`` (see the module's docstring). If the memory in use has grown (a
    handback leaves it above the ceiling), that is the new level: it never trims in a loop.
    On any other malloc it does nothing.

    Example::

        bound = ResidentBound()
        ...  # load, warm up at the largest batch
        bound.settle()
        while serving:
            ...  # run a batch, send its answers
            bound.after_batch()
    """

    def __init__(self, slack: float = RESIDENT_SLACK, interval_s: float = TRIM_INTERVAL_S) -> None:
        self.slack = slack
        self.interval_s = interval_s
        self.trims = 0
        self.ceiling: int | None = None
        self._libc = _glibc()
        self._last_trim = -math.inf

    def settle(self) -> None:
        """Take the current level as the reference: call it warmed up at the largest batch."""
        if self._libc is not None:
            self.ceiling = int(anonymous_bytes() * (1 + self.slack))

    def after_batch(self) -> bool:
        """Hand the free pages back if the memory is past the ceiling and the last handback
        is ``interval_s`` old. Returns whether it did. Cheap otherwise (one small read)."""
        if self.ceiling is None or anonymous_bytes() <= self.ceiling:
            return False
        now = time.monotonic()
        if now - self._last_trim < self.interval_s:
            return False
        assert self._libc is not None
        self._libc.malloc_trim(0)
        self._last_trim = now
        self.trims += 1
        after = anonymous_bytes()
        if after > self.ceiling:
            self.ceiling = int(after * (1 + self.slack))
            log.info("memory in use grew: the worker's ceiling is now %d MB", self.ceiling >> 20)
        return True
