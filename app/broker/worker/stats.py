"""What a broker worker has run, as its heartbeat reports it (front ends sum the heartbeats
of the workers alive into ``/metrics``: ``app.metrics``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from app.jobs import Task
from app.metrics.labels import LATENCY_BUCKETS, LOAD_BUCKETS

MAX_TENANTS = 64  # tenants whose waits a heartbeat carries (its size is bounded: 64 KB)
MAX_LOADED = 64  # model names whose loads it carries (the first a worker loaded)


def _histogram(buckets: Sequence[float] = LATENCY_BUCKETS) -> list[float]:
    """Counts per bucket (not cumulative), then +Inf, then the sum."""
    return [0.0] * (len(buckets) + 2)


def _observe(
    histogram: list[float], value: float, buckets: Sequence[float] = LATENCY_BUCKETS
) -> None:
    index = next((i for i, le in enumerate(buckets) if value <= le), len(buckets))
    histogram[index] += 1
    histogram[-1] += value


@dataclass
class ConsumerStats:
    """What a worker has run, sent with every heartbeat (front ends turn it into metrics)."""

    batches: int = 0
    items: int = 0
    mixed_batches: int = 0  # batches holding items from more than one front end
    expired: int = 0  # dropped unrun: their deadline had passed
    malformed: int = 0  # dropped unrun: not our format
    reclaimed: int = 0  # taken over from a worker that died or hung
    given_up: int = 0  # answered 500 after MB_MAX_DELIVERIES deliveries
    shed: int = 0  # answered 429 unrun: past their priority level's queue timeout
    shared: int = 0  # answered by an identical request's computation (worker.sharing)
    reconnects: int = 0  # Redis reached again after it could not be (a failover, a restart)
    # By served id, then task: batches by size, and the model-time and queue-wait histograms.
    sizes: dict[str, dict[Task, dict[int, int]]] = field(default_factory=dict)
    model_s: dict[str, dict[Task, list[float]]] = field(default_factory=dict)
    wait_s: dict[str, dict[Task, list[float]]] = field(default_factory=dict)
    size_s: dict[str, dict[Task, dict[int, float]]] = field(default_factory=dict)  # by size
    # By tenant (from its lane's name, app.broker.wire.lanes): the queue-wait histogram.
    tenant_wait_s: dict[str, list[float]] = field(default_factory=dict)
    # By model name: the loads that went into service (``LOAD_BUCKETS`` histogram), and those
    # that failed, by step; kept when a version is unloaded (counters of the worker's life).
    load_s: dict[str, list[float]] = field(default_factory=dict)
    load_failures: dict[str, dict[str, int]] = field(default_factory=dict)

    def on_load(self, name: str, version: int, seconds: float, failed_step: str | None) -> None:
        """A load of ``name``'s ``version`` ended (``app.workers.hands.LoadObserver``)."""
        named = self.load_s.keys() | self.load_failures.keys()
        if name not in named and len(named) >= MAX_LOADED:
            return
        if failed_step is None:
            load = self.load_s.setdefault(name, _histogram(LOAD_BUCKETS))
            _observe(load, seconds, LOAD_BUCKETS)
        else:
            failures = self.load_failures.setdefault(name, {})
            failures[failed_step] = failures.get(failed_step, 0) + 1

    def record(
        self,
        served_id: str,
        task: Task,
        size: int,
        frontends: int,
        model_s: float,
        waits: list[float],
        tenants: Sequence[str | None] = (),
    ) -> None:
        """A batch of ``size`` run (0: none, every entry answered by another's computation),
        and the queue waits of every entry it answered."""
        if size:
            self.batches += 1
            self.items += size
            self.mixed_batches += frontends > 1
            sizes = self.sizes.setdefault(served_id, {}).setdefault(task, {})
            sizes[size] = sizes.get(size, 0) + 1
            model = self.model_s.setdefault(served_id, {}).setdefault(task, _histogram())
            _observe(model, model_s)
            by_size = self.size_s.setdefault(served_id, {}).setdefault(task, {})
            by_size[size] = by_size.get(size, 0.0) + model_s
        histogram = self.wait_s.setdefault(served_id, {}).setdefault(task, _histogram())
        for wait in waits:
            _observe(histogram, wait)
        for wait, tenant in zip(waits, tenants, strict=False):
            if tenant is not None and (
                tenant in self.tenant_wait_s or len(self.tenant_wait_s) < MAX_TENANTS
            ):
                _observe(self.tenant_wait_s.setdefault(tenant, _histogram()), wait)

    def forget(self, served_id: str) -> None:
        """Drop an unloaded version's figures, so the heartbeat stays bounded."""
        for table in (self.sizes, self.model_s, self.wait_s, self.size_s):
            table.pop(served_id, None)
