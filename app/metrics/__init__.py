"""Prometheus metrics, one registry per app (so tests can build several apps side by side).

Counters and histograms are updated where things happen (HTTP edge, Streamer, worker pool);
gauges (queue depth, workers alive/ready) are read from live state at scrape time.

Two modes change where some figures come from:

* Several front-end processes (uvicorn ``--workers``, gunicorn) share
  ``PROMETHEUS_MULTIPROC_DIR``: counters and histograms go to files there, and a scrape of
  any one process sums them all (prometheus-client's multiprocess mode). The live gauges
  come from the process that answers the scrape.
* Broker mode (``remote_workers``): batches form and versions load in the model workers, so
  the batch sizes, queue waits and model times they ran, and the loads they ended, come from
  their heartbeats (``on_workers``), summed over the workers (``app.metrics.reported``), not
  from this process.

Request, batch and model-time figures carry ``model`` (the name) and ``version`` (its number)
labels; ``labels`` turns a served id into them (the engine's registry knows).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from app import tracing
from app.cache import ResponseCache
from app.errors import ServerError
from app.metrics.labels import (
    BATCH_BUCKETS,
    BATCH_LABELS,
    LATENCY_BUCKETS,
    LOAD_BUCKETS,
    LOAD_FAILURES_HELP,
    LOAD_SECONDS_HELP,
    BatchRun,
    Children,
    Labels,
)
from app.metrics.live import CacheGauges, LiveGauges, LiveState, VersionState
from app.metrics.reported import Life, Reports, WorkerReport, WorkerReported, ran_by_version
from app.metrics.statistics import Statistics

__all__ = [
    "BATCH_BUCKETS",
    "LATENCY_BUCKETS",
    "LOAD_BUCKETS",
    "BatchRun",
    "LiveState",
    "Metrics",
    "VersionState",
    "WorkerReport",
]


class Metrics:
    """Every metric the server exports. ``render()`` gives the Prometheus text format."""

    def __init__(
        self, *, remote_workers: bool = False, multiprocess_dir: Path | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        self.remote_workers = remote_workers
        self.multiprocess_dir = multiprocess_dir
        # CPU, memory and open files of the process that answers the scrape.
        self._live: list[Collector] = [ProcessCollector(registry=None), SpansDropped()]
        self._reports = Reports()  # broker mode: the workers', what they report
        self._labelled: dict[str, tuple[str, str]] = {}  # served id -> its labels, once known
        self.labels: Labels = lambda served_id: (served_id, "")
        # The same events, per model version, in Triton's form (v2 statistics extension).
        self.statistics = Statistics()
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
            self._live.append(WorkerReported(self._reports.all, lambda: self._reported_labels))
            self.statistics.ran = lambda: ran_by_version(self._reports.all(), self._reported_labels)
            self.broker_events = Counter(
                "microbatch_broker_events",
                "Broker mode, front ends: Redis reached again after a failure (reconnect); "
                "after a failover, waiting requests whose entry was lost, sent again (resent) "
                "or too late to be (lost).",
                ["event"],
                registry=r,
            )
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
            self.tenant_queue_wait = Histogram(
                "microbatch_tenant_queue_wait_seconds",
                "Time an item waited for its batch, by its caller's tenant.",
                ["tenant"],
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
            self.load_time = Histogram(
                "microbatch_model_load_seconds",
                LOAD_SECONDS_HELP,
                ["model"],
                buckets=LOAD_BUCKETS,
                registry=r,
            )
            self.load_failures = Counter(
                "microbatch_model_load_failures",
                LOAD_FAILURES_HELP,
                ["model", "step"],
                registry=r,
            )
        self.rejected = Counter(
            "microbatch_rejected", "Requests refused, by reason.", ["reason"], registry=r
        )
        # Per tenant (app.tenancy): label values only from the keys file, so bounded by it.
        self.tenant_requests = Counter(
            "microbatch_tenant_requests",
            "Prediction requests by tenant, admitted or over its quota.",
            ["tenant", "outcome"],
            registry=r,
        )
        self.tenant_images = Counter(
            "microbatch_tenant_images",
            "Images asked for by tenant, admitted or over its quota.",
            ["tenant", "outcome"],
            registry=r,
        )
        self.tenant_refused = Counter(
            "microbatch_tenant_refused",
            "Requests of a known tenant refused, by tenant and reason (as microbatch_rejected).",
            ["tenant", "reason"],
            registry=r,
        )
        self.quota_errors = Counter(
            "microbatch_quota_errors",
            "Broker mode: quota draws Redis did not answer in time (the front end's own "
            "bucket answered instead).",
            registry=r,
        )
        # The response cache (app.cache), per image asked.
        self.cache_images = Counter(
            "microbatch_cache_images",
            "Images the response cache answered (hit: this process's; shared_hit: Redis's; "
            "coalesced: an identical request's in flight) or not (miss; fresh: no-cache).",
            ["outcome"],
            registry=r,
        )
        self.cache_evictions = Counter(
            "microbatch_cache_evictions",
            "Answers the response cache let go to stay within MB_CACHE_BYTES.",
            registry=r,
        )
        self.cache_errors = Counter(
            "microbatch_cache_errors",
            "Reads and writes the shared cache (MB_CACHE_REDIS) failed or timed out "
            "(served without it).",
            registry=r,
        )
        # What each request and batch counts, by label values, looked up once each.
        self._requests = Children(self.requests)
        self._latency = Children(self.latency)
        self._rejected = Children(self.rejected)
        self._tenant_requests = Children(self.tenant_requests)
        self._tenant_images = Children(self.tenant_images)
        self._tenant_refused = Children(self.tenant_refused)
        self._cache_images = Children(self.cache_images)
        if not remote_workers:
            self._batch_size = Children(self.batch_size)
            self._queue_wait = Children(self.queue_wait)
            self._model_time = Children(self.model_time)
            self._tenant_queue_wait = Children(self.tenant_queue_wait)

    def watch(self, read_state: Callable[[], LiveState]) -> None:
        """Export gauges read from ``read_state()`` at every scrape."""
        self._live.append(LiveGauges(read_state))

    def watch_cache(self, cache: ResponseCache) -> None:
        """Export the response cache's size at every scrape."""
        self._live.append(CacheGauges(cache))

    def on_cache(self, outcome: str) -> None:
        self._cache_images(outcome).inc()

    def on_cache_evict(self) -> None:
        self.cache_evictions.inc()

    def on_cache_error(self) -> None:
        self.cache_errors.inc()

    def on_broker_event(self, event: str) -> None:
        """Broker mode: ``app.broker.front.failover``'s ``reconnect``, ``resent``, ``lost``."""
        self.broker_events.labels(event).inc()

    def on_workers(self, workers: Sequence[Life]) -> None:
        """Broker mode: the heartbeats of the workers alive, with what each has run."""
        self._reports.update(workers)

    def _reported_labels(self, served_id: str) -> tuple[str, str]:
        """Broker mode: a served id's labels, as they were once its name and version were
        known (the workers' figures of a version stay after the registry forgets it: under
        the labels they had, not ``("", "")``)."""
        found = self.labels(served_id)
        if found != ("", ""):
            self._labelled[served_id] = found
        return self._labelled.get(served_id, found)

    def on_batch(
        self, task: str, size: int, waits: Sequence[float], model: str = "", version: str = ""
    ) -> None:
        self._batch_size(task, model, version).observe(size)
        self.statistics.on_batch(model, version, size, waits)
        histogram = self._queue_wait(task, model, version)
        for wait in waits:
            histogram.observe(wait)

    def on_tenant_waits(self, waits: Sequence[float], tenants: Sequence[Hashable]) -> None:
        """Each item's queue wait under its tenant (items of no tenant, the batch job's, are
        not counted)."""
        for wait, tenant in zip(waits, tenants, strict=True):
            if tenant is not None:
                self._tenant_queue_wait(str(tenant)).observe(wait)

    def on_run(self, run: BatchRun, model: str = "", version: str = "") -> None:
        self._model_time(run.task, model, version).observe(run.compute_s)
        self.statistics.on_run(model, version, run.size, run.compute_s)

    def on_load(self, model: str, version: int, seconds: float, failed_step: str | None) -> None:
        """A load of ``model``'s ``version`` ended (``app.workers.hands.LoadObserver``); in
        broker mode the workers count their own (``app.metrics.reported``)."""
        if failed_step is None:
            self.load_time.labels(model).observe(seconds)
        else:
            self.load_failures.labels(model, failed_step).inc()

    def on_error(self, error: ServerError | type[ServerError], tenant: str | None = None) -> None:
        """Count a refusal under its ``reject_reason`` (see ``app.errors``), and under its
        ``tenant`` when the caller is known; other errors are not counted. A class stands for
        a refusal that FastAPI or Starlette made itself."""
        reason = error.reject_reason
        if reason is not None:
            self._rejected(reason).inc()
            if tenant is not None:
                self._tenant_refused(tenant, reason).inc()

    def on_tenant_images(self, tenant: str, images: int, allowed: bool) -> None:
        """A request of ``tenant`` drew ``images`` from its quota (or had none)."""
        outcome = "admitted" if allowed else "over_quota"
        self._tenant_requests(tenant, outcome).inc()
        self._tenant_images(tenant, outcome).inc(images)

    def on_quota_error(self) -> None:
        self.quota_errors.inc()

    def on_request(
        self,
        route: str,
        status: int,
        seconds: float,
        model: str = "",
        version: str = "",
        *,
        inference: bool = False,
    ) -> None:
        """A request answered; ``inference``: one that ran (or tried to run) a model."""
        self._requests(route, str(status), model, version).inc()
        self._latency(route, model, version).observe(seconds)
        if inference and model:
            self.statistics.on_request(model, version, ok=status < 400, seconds=seconds)

    def render(self) -> bytes:
        registry = self.registry
        if self.multiprocess_dir is not None:  # every process's counters, from their files
            registry = CollectorRegistry()
            path = str(self.multiprocess_dir)
            MultiProcessCollector(registry, path=path)  # type: ignore[no-untyped-call]
        return generate_latest(_Joined(registry, *self._live))


class SpansDropped(Collector):
    """Trace spans this process dropped instead of slowing a request (``app.tracing``): a
    full export queue, or an exporter that failed (a collector down)."""

    def collect(self) -> Iterator[Any]:
        family = CounterMetricFamily(
            "microbatch_trace_spans_dropped",
            "Trace spans dropped by this process (tracing on), by reason.",
            labels=["reason"],
        )
        for reason, count in tracing.spans_dropped().items():
            family.add_metric([reason], count)
        yield family


class _Joined:
    """What ``generate_latest`` reads: a registry's metrics, then the live ones."""

    def __init__(self, *sources: CollectorRegistry | Collector) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Any]:
        for source in self._sources:
            yield from source.collect()
