"""The buckets and labels every metric of this server uses, and what one batch run reports
(kept apart so the broker's worker statistics can import them without the registry)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound="MetricWrapperBase")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LOAD_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
BATCH_LABELS = ["task", "model", "version"]
# The load metrics' help: the same whether a process counts its own loads or its workers'.
LOAD_SECONDS_HELP = "Loads of a model version that ended serving: from the call to the switch."
LOAD_FAILURES_HELP = "Loads of a model version that failed (the version before serves on), by step."


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


class Children(Generic[M]):
    """A labelled metric's children by their label values, each looked up once.
    ``labels()`` checks and converts its arguments on every call, a few microseconds of
    every request for each metric it counts; the children themselves are the metric's own,
    which keeps them as long as the registry lives (this holds no other)."""

    __slots__ = ("_children", "_metric")

    def __init__(self, metric: M) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child
