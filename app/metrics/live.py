"""The gauges read from live state at every scrape (``Metrics.watch``): the queue, the
workers alive and ready, their memory and runtimes, and the model versions by state (with
a version's slowdown on a runtime slower than one that failed)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from app.batching import WorkerStatus
from app.cache import ResponseCache
from app.manifest import Manifest


@dataclass(frozen=True)
class VersionState:
    """One model version as the gauges show it."""

    name: str
    version: int
    served_id: str
    state: str  # an app.lifecycle.VersionState, as the index shows it
    manifest: Manifest | None = None
    serving: bool = False  # the version its name serves now
    runtime: str | None = None  # what runs it on the workers
    slowdown: float | None = None  # times slower than a runtime that failed its self-test


@dataclass(frozen=True)
class LiveState:
    """What the gauges show, read at every scrape (``Metrics.watch``)."""

    queue_depth: int = 0
    in_flight: int = 0
    workers: Sequence[WorkerStatus] = ()
    versions: Sequence[VersionState] = ()


class LiveGauges(Collector):
    """Gauges from ``read()``, called at every scrape."""

    def __init__(self, read: Callable[[], LiveState]) -> None:
        self._read = read
        self._restarts = Restarts()

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
        cpu = CounterMetricFamily(
            "microbatch_worker_cpu_seconds",
            "CPU time (user + system) each model worker has used since it started.",
            labels=["worker", "device"],
        )
        for worker in state.workers:
            name = worker.name or str(worker.index)
            if worker.rss_bytes is not None:
                memory.add_metric([name, worker.device], worker.rss_bytes)
            if worker.cpu_seconds is not None:
                cpu.add_metric([name, worker.device], worker.cpu_seconds)
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
        restarts.add_metric([], self._restarts.total(state.workers))
        yield from (depth, in_flight, alive, ready, memory, cpu, runtimes, model_memory, restarts)
        yield from _versions(state.versions)


class Restarts:
    """The workers' restarts, summed so that the counter never goes down: each worker name's
    last count stays after it leaves the workers seen (broker mode sees only those with a
    fresh heartbeat, and a restart takes longer), and a count that went down (its
    supervisor started again) adds the one before to those gone."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._gone = 0

    def total(self, workers: Sequence[WorkerStatus]) -> int:
        for worker in workers:
            name = worker.name or str(worker.index)
            before = self._last.get(name, 0)
            if worker.restarts < before:
                self._gone += before
            self._last[name] = worker.restarts
        return self._gone + sum(self._last.values())


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
    slower = GaugeMetricFamily(
        "microbatch_model_runtime_slowdown",
        "How many times slower a version runs than on the runtime its export measured "
        "fastest, which failed its self-test or its load here (absent: not slower).",
        labels=["model", "version", "runtime"],
    )
    for version in versions:
        if version.slowdown is not None:
            slower.add_metric(
                [version.name, str(version.version), version.runtime or ""], version.slowdown
            )
    yield slower
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


class CacheGauges(Collector):
    """The response cache's size in this process, read at every scrape."""

    def __init__(self, cache: ResponseCache) -> None:
        self._cache = cache

    def collect(self) -> Iterator[GaugeMetricFamily]:
        memory = self._cache.memory
        size = GaugeMetricFamily(
            "microbatch_cache_bytes", "Bytes the response cache holds in this process."
        )
        size.add_metric([], memory.bytes if memory is not None else 0)
        entries = GaugeMetricFamily(
            "microbatch_cache_entries", "Answers the response cache holds in this process."
        )
        entries.add_metric([], len(memory) if memory is not None else 0)
        flights = GaugeMetricFamily(
            "microbatch_cache_in_flight",
            "Answers being computed now, each for one tenant's requests (single-flight).",
        )
        flights.add_metric([], self._cache.in_flight)
        yield from (size, entries, flights)
