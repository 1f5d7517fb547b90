"""The project's performance targets, in one table that the verdicts read.

Each row is a :class:`Target`: a bound on one ratio, for one model and one concurrency, or
for any (``None``). A lookup takes the most specific row that matches::

    >>> target(Metric.SATURATION, "resnet50").bound
    0.9
    >>> target(Metric.VS_STREAMER_THROUGHPUT, "efficientnet_lite0", clients=8).bound
    1.3
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Metric(StrEnum):
    """The ratios the targets are stated in."""

    SATURATION = "saturation"  # this server's best at 64 clients / the raw pipeline's best
    IDLE_RATIO = "idle ratio"  # p50 at 1 client / the raw loop's p50 at batch 1
    IDLE_ADDED_MS = "idle added ms"  # p50 at 1 client - the raw loop's p50 at batch 1
    VS_STREAMER_THROUGHPUT = "throughput vs service-streamer"  # ours / theirs, same clients
    VS_STREAMER_P50 = "p50 vs service-streamer"  # ours / theirs, same clients
    RUNTIME_SATURATION = "runtime saturation"  # ours+<runtime>@64 / that runtime's raw best
    RUNTIME_GAIN = "runtime gain"  # ours+<runtime>@64 / ours (TorchScript fp32)@64
    RUNTIME_IDLE = "runtime idle"  # p50 of ours+<runtime>@1 / ours (TorchScript fp32)@1
    # Against the baseline commit (--baseline), in the same run:
    VS_BEFORE = "throughput vs before"  # ours@64 / the baseline's@64 (same configuration)
    P50_VS_BEFORE = "lone p50 vs before"  # p50@1 / the baseline's p50@1, in turns
    # Issue #40: this server with its defaults / the plain FastAPI app on the same runtime
    # with OpenVINO's defaults (bench.peers.openvino_app), same clients; at 1 client the
    # ratio of their lone p50s, in turns. Its runtime is "bf16" on a CPU with bf16 units.
    VS_PLAIN = "throughput vs plain OpenVINO"
    # Issue #36: the v2 protocol's images/s (HTTP with binary tensors, or gRPC) / those of
    # /predict/tag with a multipart upload, one server, same clients, in turns
    VS_PREDICT = "images/s vs /predict/tag"
    # The CPU an image costs outside the model (machinery step, do-nothing model). The share
    # of the ceiling replaced the ratio to the bare upload endpoint (0.70 until 2026-11-26)
    # when the do-nothing model took the usual 224 input: the bare endpoint decodes nothing.
    CEILING_SHARE = "share of the ceiling"  # ours' best requests/s / the computed ceiling
    DECODE_MS = "decode ms"  # CPU ms per bench photo of the decode the default uses
    HTTP_MS = "http ms"  # CPU ms per request of the HTTP process, default settings

    @property
    def higher_is_better(self) -> bool:
        return self in _HIGHER_IS_BETTER


_HIGHER_IS_BETTER = frozenset(
    {
        Metric.SATURATION,
        Metric.RUNTIME_SATURATION,
        Metric.RUNTIME_GAIN,
        Metric.VS_STREAMER_THROUGHPUT,
        Metric.VS_BEFORE,
        Metric.CEILING_SHARE,
        Metric.VS_PLAIN,
        Metric.VS_PREDICT,
    }
)


@dataclass(frozen=True)
class Target:
    """``bound`` for ``metric`` (at least, or at most where lower is better), for ``model``
    at ``clients`` concurrent clients, on the runtime axis's ``runtime``; ``None`` matches
    any.

        >>> Target(Metric.CEILING_SHARE, 0.70).met(0.72)
        True
    """

    metric: Metric
    bound: float
    model: str | None = None
    clients: int | None = None
    runtime: str | None = None

    def met(self, value: float) -> bool:
        return value >= self.bound if self.metric.higher_is_better else value <= self.bound

    def matches(
        self, metric: Metric, model: str | None, clients: int | None, runtime: str | None
    ) -> bool:
        return (
            self.metric == metric
            and self.model in (None, model)
            and self.clients in (None, clients)
            and self.runtime in (None, runtime)
        )


TARGETS: tuple[Target, ...] = (
    Target(Metric.SATURATION, 0.80),
    Target(Metric.SATURATION, 0.90, model="resnet50"),
    Target(Metric.IDLE_RATIO, 1.10),
    Target(Metric.IDLE_ADDED_MS, 5.0),
    Target(Metric.VS_STREAMER_THROUGHPUT, 1.0),
    Target(Metric.VS_STREAMER_THROUGHPUT, 1.3, clients=8),
    Target(Metric.VS_STREAMER_P50, 1.0),
    Target(Metric.VS_STREAMER_P50, 0.5, model="efficientnet_lite0", clients=1),
    Target(Metric.RUNTIME_SATURATION, 0.90),
    Target(Metric.RUNTIME_GAIN, 1.0),  # another runtime is worth serving only if faster
    Target(Metric.RUNTIME_GAIN, 1.5, model="efficientnet_lite0", runtime="openvino"),
    Target(Metric.RUNTIME_GAIN, 2.0, model="efficientnet_lite0", runtime="openvino+bf16"),
    Target(Metric.RUNTIME_GAIN, 2.5, model="efficientnet_lite0", runtime="openvino+int8"),
    Target(Metric.RUNTIME_GAIN, 1.8, model="resnet50", runtime="openvino+bf16"),
    Target(Metric.RUNTIME_IDLE, 1.0),
    # Issue #28, against the commit before it (the Makefile's BENCH_BASELINE).
    Target(Metric.VS_BEFORE, 1.0),  # no configuration slower than before
    Target(Metric.VS_BEFORE, 1.6, model="passthrough"),
    Target(Metric.VS_BEFORE, 1.15, model="efficientnet_lite0", runtime="openvino+int8"),
    Target(Metric.P50_VS_BEFORE, 1.0),
    Target(Metric.VS_PLAIN, 1.0),  # without bf16 both compute fp32: never behind
    Target(Metric.VS_PLAIN, 1.3, runtime="bf16"),
    Target(Metric.VS_PREDICT, 0.95),  # "within 5%, or faster with no multipart to parse"
    Target(Metric.CEILING_SHARE, 0.70),
    Target(Metric.DECODE_MS, 1.2),
    Target(Metric.HTTP_MS, 0.25),
)


def target(
    metric: Metric,
    model: str | None = None,
    clients: int | None = None,
    runtime: str | None = None,
) -> Target:
    """The row of :data:`TARGETS` for ``metric`` that fits ``model`` at ``clients`` (and
    ``runtime``) best: the runtime's first, then model and concurrency, then model alone, then
    concurrency alone, then the default. LookupError where none fits."""
    rows = [row for row in TARGETS if row.matches(metric, model, clients, runtime)]
    if not rows:
        raise LookupError(f"no target for {metric} (model {model}, {clients} clients)")
    return max(
        rows,
        key=lambda row: (
            4 * (row.runtime is not None) + 2 * (row.model is not None) + (row.clients is not None)
        ),
    )
