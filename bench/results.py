"""What one benchmark run records, shared by the run (``python -m bench``), its verdicts and
its writers."""

from __future__ import annotations

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
    # p50 ms at 1 client of this server with its defaults and of the plain OpenVINO app,
    # measured in turns (both serving at once)
    vs_plain_p50: tuple[float, float] | None = None
    bf16_cpu: bool = False  # the host computes bf16 natively (the targets against it differ)

    def best_raw(self, runtime: str = "torchscript") -> float:
        raw = self.raw if runtime == "torchscript" else self.raw_runtimes[runtime]
        return max(rate for rate, _ in raw.values())

    def point(self, system: str, clients: int) -> Point | None:
        return next((p for p in self.points if p.system == system and p.clients == clients), None)


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
