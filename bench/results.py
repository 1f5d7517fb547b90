"""What one benchmark run records, shared by the run (``python -m bench``), its verdicts and
its writers."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class Point:
    """One system at one concurrency: ``Point("ours", 8, 410.0, 19.0, 31.0, 7.6, 0, 42.0)``."""

    system: str
    clients: int
    images_per_s: float
    p50_ms: float
    p99_ms: float
    mean_batch: float
    errors: int
    client_cpu_pct: float
    server_cpu_ms: float = 0.0  # CPU per image of the server and its workers: cores per 1,000/s
    serving: str = ""  # this server: the runtime and precision its workers chose ("openvino+bf16")


@dataclass
class ModelReport:
    """Everything measured for one model: the raw pipeline by batch size, every server point
    and the idle latencies."""

    model: str
    raw: dict[int, tuple[float, float]] = field(default_factory=dict)  # bs -> (img/s, ms)
    # The runtime axis: the raw pipeline of every other runtime the export holds and of the
    # precisions below fp32 (label, e.g. "openvino+int8" -> bs -> (img/s, ms)); this server
    # with it is the system "ours+<label>".
    raw_runtimes: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)
    # label -> (seconds from launch to ready, the largest worker's RSS in MB after the run)
    startup: dict[str, tuple[float, float]] = field(default_factory=dict)
    # label -> its agreement with fp32 on held-back images (an ``Agreement``'s fields)
    accuracy: dict[str, dict[str, float | None]] = field(default_factory=dict)
    points: list[Point] = field(default_factory=list)
    # label -> p50 ms of that configuration at 1 client and of the raw loop at batch 1,
    # measured in turns
    idle: dict[str, tuple[float, float]] = field(default_factory=dict)
    # label -> p50 ms at 1 client of that configuration and of the same one served by the
    # baseline commit (``--baseline``), measured in turns; its points are "before<suffix>"
    vs_before_p50: dict[str, tuple[float, float]] = field(default_factory=dict)
    # p50 ms at 1 client, after a second of idle, of this server with its defaults and of the
    # plain OpenVINO app, and the median of the turns' ratios (theirs / ours): both serving
    # at once, one request of each in turn (``bench.lone``)
    vs_plain_p50: tuple[float, float, float] | None = None
    # ``bench.lone``'s verdicts on the lone request (its breakdown is printed as it runs)
    lone: list[str] = field(default_factory=list)
    bf16_cpu: bool = False  # the host computes bf16 natively (the targets against it differ)

    def best_raw(self, runtime: str = "torchscript") -> float:
        raw = self.raw if runtime == "torchscript" else self.raw_runtimes[runtime]
        return max(rate for rate, _ in raw.values())

    def point(self, system: str, clients: int) -> Point | None:
        return next((p for p in self.points if p.system == system and p.clients == clients), None)


# Issue #36: the ways one server answers the same photo, in the order a round first takes them.
PREDICT, V2_HTTP, V2_GRPC = "/predict/tag", "v2 http", "v2 grpc"
PROTOCOLS = (PREDICT, V2_HTTP, V2_GRPC)


@dataclass
class ProtocolReport:
    """One server with its defaults answering the same photos three ways, in turns
    (``bench.protocols``): /predict/tag with a multipart upload, the v2 ``infer`` over HTTP
    with the binary tensor extension, and over gRPC.

        >>> r = ProtocolReport("efficientnet_lite0", rounds={
        ...     PREDICT: {8: [100.0, 80.0, 90.0]}, V2_HTTP: {8: [104.0, 76.0, 99.0]}})
        >>> round(r.ratio(V2_HTTP, 8), 2)
        1.04
    """

    model: str
    serving: str = ""  # the runtime and precision its worker chose ("openvino+bf16")
    # system: the way; images/s: the median of the rounds; p50 and p99: of all the rounds'
    # requests together
    points: list[Point] = field(default_factory=list)
    # way -> clients -> images/s of each round, round i of every way measured side by side
    rounds: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    # way -> clients -> CPU ms per request of the HTTP process alone (where gRPC is served
    # too): the part of server_cpu_ms a protocol's parsing and answering can change
    http_cpu_ms: dict[str, dict[int, float]] = field(default_factory=dict)

    def point(self, way: str, clients: int) -> Point | None:
        return next((p for p in self.points if p.system == way and p.clients == clients), None)

    def ratio(self, way: str, clients: int) -> float | None:
        """``way``'s images/s over /predict/tag's at ``clients``: the median of the rounds'
        ratios, each of two turns a few seconds apart (drift between rounds cancels)."""
        ours, base = self.rounds.get(way, {}).get(clients), self.rounds[PREDICT].get(clients)
        if not ours or not base:
            return None
        return statistics.median(a / b for a, b in zip(ours, base, strict=True) if b > 0)


# The machinery step's systems: label, kind, workers, settings. The bare endpoint; the same
# endpoint decoding each upload with Pillow; this server with its defaults (one worker with
# every thread), and with the thread budget split into single-thread workers. The verdicts
# take the best of those of kind "ours". With --baseline, "before" is the baseline commit's
# server with its defaults.
MACHINERY_SYSTEMS: list[tuple[str, str, int, dict[str, str]]] = [
    ("noop", "noop", 1, {}),
    ("decoding", "decode", 1, {}),
    ("ours", "ours", 1, {}),
    ("ours-2w", "ours", 2, {}),
]
