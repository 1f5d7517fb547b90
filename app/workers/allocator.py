"""Make a worker keep the memory its batches free, instead of handing it back to the kernel.

glibc's malloc serves a large request with fresh ``mmap`` pages and unmaps them on ``free``
(the cut-off starts at 128 KiB and adapts, up to 32 MiB), and it returns the top of its heap
to the kernel once enough of it is free. A network's activations are exactly such requests,
allocated and freed on every call, so each call would touch fresh pages that the kernel must
fault in and zero; a mix of batch sizes defeats glibc's adaptation. A worker's working set
is bounded by its largest batch, so holding on to it costs the memory that batch needs
anyway, and no time. Figures: ``docs/performance.md``.

Only glibc (Linux) is tuned; elsewhere ``retain_freed_memory`` does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger(__name__)

# mallopt(3) parameters, from <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# Requests below this come from the heap, whose freed chunks are reused: room for a batch-32
# activation of the bench models with a wide margin. mallopt takes a C int, so < 2 GiB.
MMAP_THRESHOLD_BYTES = 512 << 20
# Give memory back only when this much sits free at the top of the heap.
TRIM_THRESHOLD_BYTES = 1 << 30


def retain_freed_memory() -> bool:
    """Tune glibc's malloc in this process so freed memory is reused, not unmapped. Returns
    whether it applied (False off glibc). Call it once, early, in a worker process."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    applied = bool(
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    if not applied:
        log.warning("glibc refused the malloc thresholds; batches will fault in fresh pages")
    return applied
