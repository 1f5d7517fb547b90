"""Broker mode: the batches the model workers ran and the loads they ended, from their
heartbeats (each worker's ``app.broker.worker.stats.ConsumerStats``), summed into the same
metrics an in-process server keeps itself: batch sizes, queue waits and model times; load
times, and loads failed by step. The sums take each worker's last report, and keep it after
the worker leaves (``Reports``): a counter never goes down because a worker stopped."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from time import monotonic
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from app.jobs import Task
from app.metrics.labels import (
    BATCH_BUCKETS,
    BATCH_LABELS,
    LATENCY_BUCKETS,
    LOAD_BUCKETS,
    LOAD_FAILURES_HELP,
    LOAD_SECONDS_HELP,
    Labels,
)
from app.metrics.statistics import Duration, Ran

# served id -> task -> ...: what a broker worker's heartbeat reports per model it serves.
ByModel = Mapping[str, Mapping[Task, Any]]


# How long a worker that stopped sending heartbeats keeps its own report (it may come back:
# a paused process): after that, its figures join those of the workers gone before it.
KEEP_S = 600.0


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
    def size_s(self) -> Mapping[str, Mapping[Task, Mapping[int, float]]]: ...
    @property
    def tenant_wait_s(self) -> Mapping[str, Sequence[float]]: ...
    @property
    def reclaimed(self) -> int: ...
    @property
    def reconnects(self) -> int: ...
    @property
    def shared(self) -> int: ...
    @property
    def load_s(self) -> Mapping[str, Sequence[float]]: ...
    @property
    def load_failures(self) -> Mapping[str, Mapping[str, int]]: ...


class Life(WorkerReport, Protocol):
    """A worker's report, with what tells its lives apart (a restart keeps its name, and a
    restarted container often its pid: ``life`` is drawn at each start)."""

    @property
    def name(self) -> str: ...
    @property
    def pid(self) -> int: ...
    @property
    def life(self) -> str: ...


@dataclass
class Gone:
    """The last reports of the workers gone, added up (a ``WorkerReport`` of its own)."""

    sizes: dict[str, dict[Task, dict[int, int]]] = field(default_factory=dict)
    model_s: dict[str, dict[Task, list[float]]] = field(default_factory=dict)
    wait_s: dict[str, dict[Task, list[float]]] = field(default_factory=dict)
    size_s: dict[str, dict[Task, dict[int, float]]] = field(default_factory=dict)
    tenant_wait_s: dict[str, list[float]] = field(default_factory=dict)
    reclaimed: int = 0
    reconnects: int = 0
    shared: int = 0
    load_s: dict[str, list[float]] = field(default_factory=dict)
    load_failures: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, report: WorkerReport) -> None:
        self.reclaimed += report.reclaimed
        self.reconnects += report.reconnects
        self.shared += report.shared
        _add_by_size(self.sizes, report.sizes)
        _add_by_size(self.size_s, report.size_s)
        for mine, theirs in ((self.model_s, report.model_s), (self.wait_s, report.wait_s)):
            for served_id, histograms in theirs.items():
                _add_histograms(mine.setdefault(served_id, {}), histograms, LATENCY_BUCKETS)
        _add_histograms(self.tenant_wait_s, report.tenant_wait_s, LATENCY_BUCKETS)
        _add_histograms(self.load_s, report.load_s, LOAD_BUCKETS)
        for name, steps in report.load_failures.items():
            _add_counts(self.load_failures.setdefault(name, {}), steps)


def _versions(report: WorkerReport) -> set[str]:
    """The served ids ``report`` has figures of."""
    return {*report.sizes, *report.model_s, *report.wait_s, *report.size_s}


def _of_versions(report: WorkerReport, served_ids: set[str]) -> Gone:
    """What ``report`` says of ``served_ids`` alone."""
    part = Gone()
    tables: tuple[tuple[dict[str, Any], Mapping[str, Any]], ...] = (
        (part.sizes, report.sizes), (part.model_s, report.model_s),
        (part.wait_s, report.wait_s), (part.size_s, report.size_s),
    )  # fmt: skip
    for mine, theirs in tables:
        mine.update({served_id: theirs[served_id] for served_id in served_ids & theirs.keys()})
    return part


def _add_by_size(
    into: dict[str, dict[Task, dict[int, Any]]],
    by_size: Mapping[str, Mapping[Task, Mapping[int, Any]]],
) -> None:
    for served_id, tasks in by_size.items():
        for task, counts in tasks.items():
            _add_counts(into.setdefault(served_id, {}).setdefault(task, {}), counts)


def _add_counts(into: dict[Any, Any], counts: Mapping[Any, Any]) -> None:
    """Add ``counts`` (key -> a count, or seconds) into ``into``, key by key."""
    for key, n in counts.items():
        into[key] = into.get(key, 0) + n


def _add_histograms(
    into: dict[Any, list[float]],
    histograms: Mapping[Any, Sequence[float]],
    buckets: Sequence[float],
) -> None:
    for key, counts in histograms.items():
        if len(counts) == len(buckets) + 2:  # one of another release's buckets is left out
            mine = into.setdefault(key, [0.0] * len(counts))
            into[key] = [a + float(b) for a, b in zip(mine, counts, strict=True)]


class Reports:
    """Each worker life's last report (by name, pid and life), what the sums are taken over: a
    worker that stops sending heartbeats keeps its figures in them (for ``KEEP_S`` as its
    own, in case it comes back, then in ``Gone``), and so do the versions a worker unloaded
    (its heartbeat drops their figures): the sums never go down."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, int, str], tuple[WorkerReport, float]] = {}
        self._gone = Gone()

    def update(self, workers: Sequence[Life]) -> None:
        now = monotonic()
        for worker in workers:
            key = (worker.name, worker.pid, worker.life)
            if key in self._last:
                before = self._last[key][0]
                if forgotten := _versions(before) - _versions(worker):
                    self._gone.add(_of_versions(before, forgotten))
            self._last[key] = (worker, now)
        for key, (report, seen) in list(self._last.items()):
            if now - seen > KEEP_S:
                self._gone.add(report)
                del self._last[key]

    def all(self) -> list[WorkerReport]:
        return [*(report for report, _ in self._last.values()), self._gone]


def ran_by_version(reports: Sequence[WorkerReport], labels: Labels) -> dict[tuple[str, str], Ran]:
    """What the workers ran of each version (model, version), for Triton's statistics."""
    ran: dict[tuple[str, str], Ran] = {}
    for report in reports:
        for served_id, tasks in report.sizes.items():
            entry = ran.setdefault(labels(served_id), Ran())
            for task, counts in tasks.items():
                seconds = report.size_s.get(served_id, {}).get(task, {})
                for size, n in counts.items():
                    entry.images += size * n
                    entry.executions += n
                    entry.compute.add(size * seconds.get(size, 0.0), size * n)
                    entry.batches.setdefault(size, Duration()).add(seconds.get(size, 0.0), n)
        for served_id, waits in report.wait_s.items():
            entry = ran.setdefault(labels(served_id), Ran())
            for histogram in waits.values():
                if len(histogram) == len(LATENCY_BUCKETS) + 2:
                    entry.queue.add(histogram[-1], round(sum(histogram[:-1])))
    return ran


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
    ``app.broker.worker.stats.ConsumerStats``), summed over the workers (``Reports``)."""

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
            ("microbatch_worker_shared_images", "Images the live workers answered with an "
             "identical request's computation (the response cache on: from the same batch, or "
             "computed moments before), sent through any front end.",
             sum(w.shared for w in workers)),
        ):  # fmt: skip
            yield CounterMetricFamily(name, documentation, value=count)
        sizes: dict[tuple[str, str, str], dict[int, int]] = {}
        for worker in workers:
            for served_id, tasks in worker.sizes.items():
                for task, counts in tasks.items():
                    _add_counts(sizes.setdefault((str(task), *labels(served_id)), {}), counts)
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
        yield _tenant_family([worker.tenant_wait_s for worker in workers])
        yield _latency_family(
            [worker.model_s for worker in workers],
            labels,
            "microbatch_model_seconds",
            "Worker time per batch (decode + model), by task and model version.",
        )
        yield from _load_families(workers)


def _load_families(
    workers: Sequence[WorkerReport],
) -> Iterator[HistogramMetricFamily | CounterMetricFamily]:
    """The loads the workers ended: their times, by model name, and those that failed, by
    name and step (what ``app.metrics.Metrics.on_load`` counts in-process)."""
    times = HistogramMetricFamily(
        "microbatch_model_load_seconds",
        LOAD_SECONDS_HELP,
        labels=["model"],
    )
    for name, counts in sorted(_added([w.load_s for w in workers], LOAD_BUCKETS).items()):
        times.add_metric([name], _cumulative(counts, LOAD_BUCKETS), counts[-1])
    yield times
    failed: dict[tuple[str, str], int] = {}
    for worker in workers:
        for name, steps in worker.load_failures.items():
            _add_counts(failed, {(name, step): count for step, count in steps.items()})
    failures = CounterMetricFamily(
        "microbatch_model_load_failures",
        LOAD_FAILURES_HELP,
        labels=["model", "step"],
    )
    for (name, step), count in sorted(failed.items()):
        failures.add_metric([name, step], count)
    yield failures


def _added(
    reports: Sequence[Mapping[Any, Sequence[float]]], buckets: Sequence[float] = LATENCY_BUCKETS
) -> dict[Any, list[float]]:
    """Histograms (bucket counts, then the sum) added up by their key."""
    totals: dict[Any, list[float]] = {}
    for report in reports:
        _add_histograms(totals, report, buckets)
    return totals


def _cumulative(
    counts: Sequence[float], buckets: Sequence[float] = LATENCY_BUCKETS
) -> list[tuple[str, float]]:
    """Bucket counts as Prometheus's cumulative buckets (the sum, last, left out)."""
    bounds = [str(float(le)) for le in buckets] + ["+Inf"]
    running, cumulative = 0.0, []
    for bound, count in zip(bounds, counts[:-1], strict=True):
        running += count
        cumulative.append((bound, running))
    return cumulative


def _tenant_family(reports: Sequence[Mapping[str, Sequence[float]]]) -> HistogramMetricFamily:
    """The workers' queue waits by tenant (the lanes' tenants: a keys file's names)."""
    family = HistogramMetricFamily(
        "microbatch_tenant_queue_wait_seconds",
        "Time an item waited for its batch, by its caller's tenant.",
        labels=["tenant"],
    )
    for tenant, counts in sorted(_added(reports).items()):
        family.add_metric([tenant], _cumulative(counts), counts[-1])
    return family


def _latency_family(
    reports: Sequence[Mapping[str, Mapping[Task, Sequence[float]]]],
    labels: Labels,
    name: str,
    documentation: str,
) -> HistogramMetricFamily:
    """The workers' latency histograms (bucket counts, then the sum), added up by task and
    model version."""
    totals = _added(
        [
            {(str(task), *labels(served_id)): counts for task, counts in tasks.items()}
            for report in reports
            for served_id, tasks in report.items()
        ]
    )
    buckets = {key: _cumulative(counts) for key, counts in totals.items()}
    sums = {key: counts[-1] for key, counts in totals.items()}
    return _histogram_family(name, documentation, buckets, sums)
