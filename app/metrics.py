"""Prometheus metrics, one registry per app (so tests can build several apps side by side).

Counters and histograms are updated where things happen (HTTP edge, Streamer, worker pool);
gauges (queue depth, workers alive/ready) are read from live state at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from app.errors import ServerError

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class _LiveState(Collector):
    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        state = self._read()
        depth = GaugeMetricFamily("microbatch_queue_depth", "Requests waiting for a batch.")
        depth.add_metric([], state.get("queue_depth", 0))
        in_flight = GaugeMetricFamily("microbatch_batches_in_flight", "Batches running now.")
        in_flight.add_metric([], state.get("in_flight", 0))
        alive = GaugeMetricFamily(
            "microbatch_workers_alive", "Worker processes alive, by device.", labels=["device"]
        )
        ready = GaugeMetricFamily(
            "microbatch_workers_ready", "Workers loaded and serving, by device.", labels=["device"]
        )
        by_device: dict[str, list[int]] = {}
        for worker in state.get("workers", []):
            counts = by_device.setdefault(worker["device"], [0, 0])
            counts[0] += int(worker["alive"])
            counts[1] += int(worker["alive"] and worker["ready"])
        for device, (n_alive, n_ready) in sorted(by_device.items()):
            alive.add_metric([device], n_alive)
            ready.add_metric([device], n_ready)
        restarts = CounterMetricFamily(
            "microbatch_worker_restarts", "Workers restarted after dying or hanging."
        )
        restarts.add_metric([], state.get("restarts", 0))
        yield from (depth, in_flight, alive, ready, restarts)


class Metrics:
    """Every metric the server exports. ``render()`` gives the Prometheus text format."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "microbatch_http_requests",
            "HTTP requests by route and status.",
            ["route", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "microbatch_http_request_duration_seconds",
            "Request latency by route.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "microbatch_queue_wait_seconds",
            "Time an item waited for its batch, by task.",
            ["task"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.model_time = Histogram(
            "microbatch_model_seconds",
            "Worker time per batch (preprocess + model), by task.",
            ["task"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "microbatch_batch_size",
            "Images per model call, by task.",
            ["task"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.rejected = Counter(
            "microbatch_rejected", "Requests refused, by reason.", ["reason"], registry=r
        )

    def watch(self, read_state: Callable[[], dict[str, Any]]) -> None:
        """Export gauges read from ``read_state()`` at every scrape."""
        self.registry.register(_LiveState(read_state))

    def on_batch(self, key: Hashable, size: int, waits: Sequence[float]) -> None:
        task = str(key)
        self.batch_size.labels(task).observe(size)
        histogram = self.queue_wait.labels(task)
        for wait in waits:
            histogram.observe(wait)

    def on_compute(self, task: str, size: int, seconds: float) -> None:
        self.model_time.labels(task).observe(seconds)

    def on_error(self, error: ServerError | type[ServerError]) -> None:
        """Count a refusal under its ``reject_reason`` (see ``app.errors``); other errors are
        not counted. A class stands for a refusal that FastAPI or Starlette made itself."""
        reason = error.reject_reason
        if reason is not None:
            self.rejected.labels(reason).inc()

    def on_request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
