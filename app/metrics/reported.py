"""Broker mode: the batches the model workers ran, from their heartbeats (each worker's
``app.broker.worker.stats.ConsumerStats``), summed over the workers alive into the same
histograms an in-process server keeps itself: batch sizes, queue waits and model times."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from app.jobs import Task
from app.metrics.labels import BATCH_BUCKETS, BATCH_LABELS, LATENCY_BUCKETS, Labels

# served id -> task -> ...: what a broker worker's heartbeat reports per model it serves.
ByModel = Mapping[str, Mapping[Task, Any]]


class WorkerReport(Protocol):
    """Broker mode: what a worker's heartbeat says it has run
    (``app.broker.wire.heartbeat.WorkerInfo``): by served id and task, batches by size, and
    the model-time and queue-wait histograms."""

    @property
    def sizes(self) -> Mapping[str, Mapping[Task, Mapping[int, int]]]: ...
    @property
    def model_s(self) -> Mapping[str, Mapping[Task, Sequence[float]]]: ...
    @property
    def wait_s(self) -> Mapping[str, Mapping[Task, Sequence[float]]]: ...
    @property
    def reclaimed(self) -> int: ...
    @property
    def reconnects(self) -> int: ...


def _histogram_family(
    name: str,
    documentation: str,
    by_key: Mapping[tuple[str, str, str], list[tuple[str, float]]],
    sums: Mapping[tuple[str, str, str], float],
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation, labels=BATCH_LABELS)
    for key in sorted(by_key):
        family.add_metric(list(key), by_key[key], sums[key])
    return family


class WorkerReported(Collector):
    """Broker mode: the batches the workers ran, from their heartbeats (see
    ``app.broker.worker.stats.ConsumerStats``), summed over the workers alive."""

    def __init__(
        self, read: Callable[[], Sequence[WorkerReport]], labels: Callable[[], Labels]
    ) -> None:
        self._read = read
        self._labels = labels

    def collect(self) -> Iterator[HistogramMetricFamily | CounterMetricFamily]:
        workers, labels = self._read(), self._labels()
        for name, documentation, count in (
            ("microbatch_worker_reclaimed", "Entries the live workers took over from a worker "
             "that died or hung, or took back after a Redis failover.",
             sum(w.reclaimed for w in workers)),
            ("microbatch_worker_broker_reconnects", "Times the live workers reached Redis "
             "again after it could not be reached (a failover, a restart).",
             sum(w.reconnects for w in workers)),
        ):  # fmt: skip
            yield CounterMetricFamily(name, documentation, value=count)
        sizes: dict[tuple[str, str, str], dict[int, int]] = {}
        for worker in workers:
            for served_id, tasks in worker.sizes.items():
                for task, counts in tasks.items():
                    merged = sizes.setdefault((str(task), *labels(served_id)), {})
                    for size, count in counts.items():
                        merged[int(size)] = merged.get(int(size), 0) + int(count)
        buckets: dict[tuple[str, str, str], list[tuple[str, float]]] = {}
        sums: dict[tuple[str, str, str], float] = {}
        for key, counts in sizes.items():
            buckets[key] = [
                (str(float(le)), float(sum(n for size, n in counts.items() if size <= le)))
                for le in BATCH_BUCKETS
            ] + [("+Inf", float(sum(counts.values())))]
            sums[key] = float(sum(size * n for size, n in counts.items()))
        yield _histogram_family(
            "microbatch_batch_size", "Images per model call, by task and model version.",
            buckets, sums,
        )  # fmt: skip
        yield _latency_family(
            [worker.wait_s for worker in workers],
            labels,
            "microbatch_queue_wait_seconds",
            "Time an item waited for its batch, by task and model version.",
        )
        yield _latency_family(
            [worker.model_s for worker in workers],
            labels,
            "microbatch_model_seconds",
            "Worker time per batch (decode + model), by task and model version.",
        )


def _latency_family(
    reports: Sequence[Mapping[str, Mapping[Task, Sequence[float]]]],
    labels: Labels,
    name: str,
    documentation: str,
) -> HistogramMetricFamily:
    """The workers' latency histograms (bucket counts, then the sum), added up by task and
    model version."""
    totals: dict[tuple[str, str, str], list[float]] = {}
    for report in reports:
        for served_id, tasks in report.items():
            for task, counts in tasks.items():
                if len(counts) == len(LATENCY_BUCKETS) + 2:
                    key = (str(task), *labels(served_id))
                    total = totals.setdefault(key, [0.0] * len(counts))
                    totals[key] = [a + float(b) for a, b in zip(total, counts, strict=True)]
    buckets: dict[tuple[str, str, str], list[tuple[str, float]]] = {}
    sums: dict[tuple[str, str, str], float] = {}
    bounds = [str(float(le)) for le in LATENCY_BUCKETS] + ["+Inf"]
    for key, counts in totals.items():
        running, cumulative = 0.0, []
        for bound, count in zip(bounds, counts[:-1], strict=True):
            running += count
            cumulative.append((bound, running))
        buckets[key], sums[key] = cumulative, counts[-1]
    return _histogram_family(name, documentation, buckets, sums)
