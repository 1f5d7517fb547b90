"""The buckets and labels every metric of this server uses, and what one batch run reports
(kept apart so the broker's worker statistics can import them without the registry)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LOAD_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
BATCH_LABELS = ["task", "model", "version"]


@dataclass(frozen=True)
class BatchRun:
    """One batch a model worker of this process ran (``WorkerPool``'s ``on_run``)."""

    task: str
    size: int
    compute_s: float  # in the worker: decode (if any) and model
    threads: int  # the torch threads it ran on (its own plus any lent)
    worker: int = field(default=0)  # the worker's index
    model: str = ""  # the served id of the model it ran


Labels = Callable[[str], tuple[str, str]]  # served id -> (model name, version)
