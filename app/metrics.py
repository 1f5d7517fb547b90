"""Prometheus metrics, one registry per app (so tests can build several apps side by side).

Counters and histograms are updated where things happen (HTTP edge, Streamer, worker pool);
gauges (queue depth, workers alive/ready) are read from live state at scrape time.

Two modes change where some figures come from:

* Several front-end processes (uvicorn ``--workers``, gunicorn) share
  ``PROMETHEUS_MULTIPROC_DIR``: counters and histograms go to files there, and a scrape of
  any one process sums them all (prometheus-client's multiprocess mode). The live gauges
  come from the process that answers the scrape.
* Broker mode (``remote_workers``): batches form in the model workers, so the batch sizes,
  queue waits and model times they ran come from their heartbeats (``on_workers``), summed
  over the workers alive, not from this process.

Request, batch and model-time figures carry ``model`` (the name) and ``version`` (its number)
labels; ``labels`` turns a served id into them (the engine's registry knows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from app.batching import WorkerStatus
from app.errors import ServerError
from app.jobs import Task
from app.manifest import Manifest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LOAD_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
BATCH_LABELS = ["task", "model", "version"]


@dataclass(frozen=True)
class VersionState:
    """One model version as the gauges show it."""

    name: str
    version: int
    served_id: str
    state: str  # an app.repository.ModelState value
    manifest: Manifest | None = None
    serving: bool = False  # the version its name serves now


@dataclass(frozen=True)
class LiveState:
    """What the gauges show, read at every scrape (``Metrics.watch``)."""

    queue_depth: int = 0
    in_flight: int = 0
    workers: Sequence[WorkerStatus] = ()
    versions: Sequence[VersionState] = ()


# served id -> task -> ...: what a broker worker's heartbeat reports per model it serves.
ByModel = Mapping[str, Mapping[Task, Any]]


class WorkerReport(Protocol):
    """Broker mode: what a worker's heartbeat says it has run (``app.broker.wire.WorkerInfo``):
    by served id and task, batches by size, and the model-time and queue-wait histograms."""

    @property
    def sizes(self) -> Mapping[str, Mapping[Task, Mapping[int, int]]]: ...
    @property
    def model_s(self) -> Mapping[str, Mapping[Task, Sequence[float]]]: ...
    @property
    def wait_s(self) -> Mapping[str, Mapping[Task, Sequence[float]]]: ...


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


class _LiveState(Collector):
    def __init__(self, read: Callable[[], LiveState]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | InfoMetricFamily]:
        state = self._read()
        depth = GaugeMetricFamily("microbatch_queue_depth", "Requests waiting for a batch.")
        depth.add_metric([], state.queue_depth)
        in_flight = GaugeMetricFamily("microbatch_batches_in_flight", "Batches running now.")
        in_flight.add_metric([], state.in_flight)
        alive = GaugeMetricFamily(
            "microbatch_workers_alive", "Worker processes alive, by device.", labels=["device"]
        )
        ready = GaugeMetricFamily(
            "microbatch_workers_ready", "Workers loaded and serving, by device.", labels=["device"]
        )
        by_device: dict[str, list[int]] = {}
        for worker in state.workers:
            counts = by_device.setdefault(worker.device, [0, 0])
            counts[0] += int(worker.alive)
            counts[1] += int(worker.alive and worker.ready)
        for device, (n_alive, n_ready) in sorted(by_device.items()):
            alive.add_metric([device], n_alive)
            ready.add_metric([device], n_ready)
        memory = GaugeMetricFamily(
            "microbatch_worker_memory_bytes",
            "Resident memory of each model worker.",
            labels=["worker", "device"],
        )
        for worker in state.workers:
            if worker.rss_bytes is not None:
                name = worker.name or str(worker.index)
                memory.add_metric([name, worker.device], worker.rss_bytes)
        runtimes = GaugeMetricFamily(
            "microbatch_worker_runtime",
            "1 for each model a ready worker holds, labelled with the runtime it serves it with "
            "(MB_RUNTIME).",
            labels=["worker", "device", "model_id", "runtime"],
        )
        model_memory = GaugeMetricFamily(
            "microbatch_model_memory_bytes",
            "What each model costs each worker holding it (measured growth, at least its files).",
            labels=["worker", "model_id"],
        )
        for worker in state.workers:
            name = worker.name or str(worker.index)
            for held in worker.models:
                if held.runtime is not None and worker.ready:
                    runtimes.add_metric([name, worker.device, held.served_id, held.runtime], 1)
                if held.memory_bytes is not None:
                    model_memory.add_metric([name, held.served_id], held.memory_bytes)
        restarts = CounterMetricFamily(
            "microbatch_worker_restarts", "Workers restarted after dying or hanging."
        )
        restarts.add_metric([], sum(worker.restarts for worker in state.workers))
        yield from (depth, in_flight, alive, ready, memory, runtimes, model_memory, restarts)
        yield from _versions(state.versions)


def _versions(versions: Sequence[VersionState]) -> Iterator[GaugeMetricFamily | InfoMetricFamily]:
    counts = GaugeMetricFamily(
        "microbatch_model_versions",
        "Model versions known, by model and state (loading, ready, draining, failed).",
        labels=["model", "state"],
    )
    by_state: dict[tuple[str, str], int] = {}
    for version in versions:
        key = (version.name, version.state)
        by_state[key] = by_state.get(key, 0) + 1
    for (name, state), count in sorted(by_state.items()):
        counts.add_metric([name, state], count)
    yield counts
    info = InfoMetricFamily(
        "microbatch_model",
        "The version each model serves now.",
        labels=["model", "version", "model_id", "arch", "weights"],
    )
    for version in versions:
        if version.serving and version.manifest is not None:
            info.add_metric(
                [],
                {
                    "model": version.name,
                    "version": str(version.version),
                    "model_id": version.served_id,
                    "arch": version.manifest.arch,
                    "weights": version.manifest.weights,
                },
            )
    yield info


class Metrics:
    """Every metric the server exports. ``render()`` gives the Prometheus text format."""

    def __init__(
        self, *, remote_workers: bool = False, multiprocess_dir: Path | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        self.remote_workers = remote_workers
        self.multiprocess_dir = multiprocess_dir
        # CPU, memory and open files of the process that answers the scrape.
        self._live: list[Collector] = [ProcessCollector(registry=None)]
        self._workers: Sequence[WorkerReport] = ()
        self.labels: Labels = lambda served_id: (served_id, "")
        r = self.registry
        self.requests = Counter(
            "microbatch_http_requests",
            "HTTP requests by route, status and the model version that answered.",
            ["route", "status", "model", "version"],
            registry=r,
        )
        self.latency = Histogram(
            "microbatch_http_request_duration_seconds",
            "Request latency by route and model version.",
            ["route", "model", "version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        if remote_workers:
            self._live.append(_WorkerReported(lambda: self._workers, lambda: self.labels))
        else:
            self.queue_wait = Histogram(
                "microbatch_queue_wait_seconds",
                "Time an item waited for its batch, by task and model version.",
                BATCH_LABELS,
                buckets=LATENCY_BUCKETS,
                registry=r,
            )
            self.model_time = Histogram(
                "microbatch_model_seconds",
                "Worker time per batch (decode if it decodes + model), by task and model version.",
                BATCH_LABELS,
                buckets=LATENCY_BUCKETS,
                registry=r,
            )
            self.batch_size = Histogram(
                "microbatch_batch_size",
                "Images per model call, by task and model version.",
                BATCH_LABELS,
                buckets=BATCH_BUCKETS,
                registry=r,
            )
        self.rejected = Counter(
            "microbatch_rejected", "Requests refused, by reason.", ["reason"], registry=r
        )
        self.load_time = Histogram(
            "microbatch_model_load_seconds",
            "Loads of a model version that ended serving: from the call to the switch.",
            ["model"],
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.load_failures = Counter(
            "microbatch_model_load_failures",
            "Loads of a model version that failed (the version before serves on), by step.",
            ["model", "step"],
            registry=r,
        )

    def watch(self, read_state: Callable[[], LiveState]) -> None:
        """Export gauges read from ``read_state()`` at every scrape."""
        self._live.append(_LiveState(read_state))

    def on_workers(self, workers: Sequence[WorkerReport]) -> None:
        """Broker mode: the heartbeats of the workers alive, with what each has run."""
        self._workers = workers

    def on_batch(
        self, task: str, size: int, waits: Sequence[float], model: str = "", version: str = ""
    ) -> None:
        self.batch_size.labels(task, model, version).observe(size)
        histogram = self.queue_wait.labels(task, model, version)
        for wait in waits:
            histogram.observe(wait)

    def on_run(self, run: BatchRun, model: str = "", version: str = "") -> None:
        self.model_time.labels(run.task, model, version).observe(run.compute_s)

    def on_load(self, model: str, version: int, seconds: float, failed_step: str | None) -> None:
        """A load of ``model``'s ``version`` ended (``app.services.models.LoadObserver``)."""
        if failed_step is None:
            self.load_time.labels(model).observe(seconds)
        else:
            self.load_failures.labels(model, failed_step).inc()

    def on_error(self, error: ServerError | type[ServerError]) -> None:
        """Count a refusal under its ``reject_reason`` (see ``app.errors``); other errors are
        not counted. A class stands for a refusal that FastAPI or Starlette made itself."""
        reason = error.reject_reason
        if reason is not None:
            self.rejected.labels(reason).inc()

    def on_request(
        self, route: str, status: int, seconds: float, model: str = "", version: str = ""
    ) -> None:
        self.requests.labels(route, str(status), model, version).inc()
        self.latency.labels(route, model, version).observe(seconds)

    def render(self) -> bytes:
        registry = self.registry
        if self.multiprocess_dir is not None:  # every process's counters, from their files
            registry = CollectorRegistry()
            path = str(self.multiprocess_dir)
            MultiProcessCollector(registry, path=path)  # type: ignore[no-untyped-call]
        return generate_latest(_Joined(registry, *self._live))


class _Joined:
    """What ``generate_latest`` reads: a registry's metrics, then the live ones."""

    def __init__(self, *sources: CollectorRegistry | Collector) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Any]:
        for source in self._sources:
            yield from source.collect()


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


class _WorkerReported(Collector):
    """Broker mode: the batches the workers ran, from their heartbeats (see
    ``app.broker.consumer.ConsumerStats``), summed over the workers alive."""

    def __init__(
        self, read: Callable[[], Sequence[WorkerReport]], labels: Callable[[], Labels]
    ) -> None:
        self._read = read
        self._labels = labels

    def collect(self) -> Iterator[HistogramMetricFamily]:
        workers, labels = self._read(), self._labels()
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
