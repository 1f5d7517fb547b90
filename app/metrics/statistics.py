"""Cumulative inference statistics per model version, in the form of Triton's statistics
extension (``GET /v2/models/{name}/stats``, gRPC ``ModelStatistics``), fed from the same
events as the Prometheus metrics (``app.metrics.Metrics``).

- ``success``/``fail``: inference requests and their whole duration, as answered;
- ``queue``: each image's wait for its batch;
- ``compute_infer``: each image's batch in its worker (decode there, if any, and the model);
  the time is not split further, so ``compute_input`` and ``compute_output`` count the same
  images with 0 ns;
- ``batch_stats``: per batch size, the batches and their worker time;
- ``inference_count``: images batched; ``execution_count``: model calls.

In broker mode the batches run on worker hosts: a front end counts the requests it answered,
and adds what the workers ran (images, model calls, queue waits, and worker time by batch
size) from their heartbeats (``ran``: ``app.metrics.reported.ran_by_version``), the same
from every front end.

>>> stats = Statistics()
>>> stats.on_request("tagger", "1", ok=True, seconds=0.01)
>>> stats.on_batch("tagger", "1", 2, [0.001, 0.002])
>>> stats.on_run("tagger", "1", 2, 0.004)
>>> entry = stats.report([("tagger", "1")])[0]
>>> entry["inference_count"], entry["execution_count"], entry["inference_stats"]["queue"]
(2, 1, {'count': 2, 'ns': 3000000})
>>> entry["batch_stats"][0]["batch_size"], entry["batch_stats"][0]["compute_infer"]
(2, {'count': 1, 'ns': 4000000})
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += round(seconds * 1e9)

    def shown(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}

    def __add__(self, other: Duration) -> Duration:
        return Duration(self.count + other.count, self.ns + other.ns)


@dataclass
class Ran:
    """The batches of one version: images, model calls, queue waits, worker time (and by
    batch size)."""

    images: int = 0
    executions: int = 0
    queue: Duration = field(default_factory=Duration)
    compute: Duration = field(default_factory=Duration)
    batches: dict[int, Duration] = field(default_factory=dict)


@dataclass
class _Version(Ran):
    last_inference_ms: int = 0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)

    def plus(self, other: Ran) -> _Version:
        """These figures with ``other``'s batches added."""
        batches = dict(self.batches)
        for size, run in other.batches.items():
            batches[size] = batches.get(size, Duration()) + run
        return replace(
            self, images=self.images + other.images,
            executions=self.executions + other.executions, queue=self.queue + other.queue,
            compute=self.compute + other.compute, batches=batches,
        )  # fmt: skip


class Statistics:
    """The figures of every model version that has answered a request or run a batch."""

    def __init__(self) -> None:
        self._versions: dict[tuple[str, str], _Version] = {}
        # Broker mode: what the workers ran, by (model, version).
        self.ran: Callable[[], Mapping[tuple[str, str], Ran]] = dict

    def _of(self, model: str, version: str) -> _Version:
        return self._versions.setdefault((model, version), _Version())

    def on_request(self, model: str, version: str, *, ok: bool, seconds: float) -> None:
        """An inference request answered (``ok``: with its result)."""
        entry = self._of(model, version)
        (entry.success if ok else entry.fail).add(seconds)
        if ok:
            entry.last_inference_ms = int(time.time() * 1000)

    def on_batch(self, model: str, version: str, size: int, waits: Sequence[float]) -> None:
        """A batch of ``size`` images left the queue, each after its wait."""
        entry = self._of(model, version)
        entry.images += size
        entry.queue.add(sum(waits), len(waits))

    def on_run(self, model: str, version: str, size: int, seconds: float) -> None:
        """A worker ran a batch of ``size`` images in ``seconds``."""
        entry = self._of(model, version)
        entry.executions += 1
        entry.compute.add(seconds * size, size)
        entry.batches.setdefault(size, Duration()).add(seconds)

    def report(self, versions: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
        """Triton's ``model_stats`` entries of ``versions`` (model name, version), in order:
        zeros for one that has run nothing."""
        shown, ran = [], self.ran()
        for name, number in versions:
            entry = self._versions.get((name, number), _Version())
            if (name, number) in ran:
                entry = entry.plus(ran[(name, number)])
            zero = {"count": entry.compute.count, "ns": 0}
            shown.append(
                {
                    "name": name,
                    "version": number,
                    "last_inference": entry.last_inference_ms,
                    "inference_count": entry.images,
                    "execution_count": entry.executions,
                    "inference_stats": {
                        "success": entry.success.shown(),
                        "fail": entry.fail.shown(),
                        "queue": entry.queue.shown(),
                        "compute_input": zero,
                        "compute_infer": entry.compute.shown(),
                        "compute_output": zero,
                        "cache_hit": {"count": 0, "ns": 0},
                        "cache_miss": {"count": 0, "ns": 0},
                    },
                    "batch_stats": [
                        {
                            "batch_size": size,
                            "compute_input": {"count": run.count, "ns": 0},
                            "compute_infer": run.shown(),
                            "compute_output": {"count": run.count, "ns": 0},
                        }
                        for size, run in sorted(entry.batches.items())
                    ],
                }
            )
        return shown
