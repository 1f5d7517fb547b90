"""What ``bench.lone`` measured, turned into a lone request's breakdown: the steps of one
trace (``steps_of``), the p50 of each by way, ratios and differences paired by turn against
the other servers, and the table and verdicts against the issue's targets (#48)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tests.otlp import Received

ADDED_MS = 1.0  # a lone request at the client: within model + decode alone + this
WORKER_RATIO = 1.15  # the worker's time per lone image: within this x model + decode alone
CLOSED, IDLE = "closed loop", "after idle"
OURS, PLAIN, BEFORE, BROKER = "ours", "openvino-plain", "before", "broker"
BROKER_ADDED_MS = 1.0  # broker mode's lone p50: within the in-process one + this
# After idle, this server's lone p50 against the plain app's: at least this on a CPU with
# bf16 units (where this server computes bf16 and OpenVINO's defaults do too), 1.0 elsewhere.
VS_PLAIN_BF16 = 1.3
VS_BEFORE_THROUGHPUT = 0.97
# The steps of one request, in the order they happen: (label, how it is measured).
STEPS = (
    ("client", "at the client, untraced requests"),
    ("request", "the server's request span (traced)"),
    ("read upload", "HTTP body read and multipart parse"),
    ("admission", "admission"),
    ("queue", "the wait for its batch"),
    ("hand-off", "queue end to the worker's batch (pipe, shared memory, wake-up)"),
    ("batch", "the worker's batch span"),
    ("decode", "decode in the worker"),
    ("model", "the model call in the worker"),
    ("way back", "batch end to the answer's encoding"),
    ("encode", "the answer's JSON"),
    ("reply", "the response sent"),
    ("outside", "client (traced) minus the request span: sockets, HTTP parse"),
)


@dataclass
class Sample:
    """What the turns measured, by way (``CLOSED`` or ``IDLE``)."""

    client_ms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    # Another server's p50s at the client (the plain app, the baseline): sender -> way -> ms
    others_ms: dict[str, dict[str, list[float]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )
    traced: dict[str, dict[str, float]] = field(default_factory=dict)  # trace id -> client ms
    way_of: dict[str, str] = field(default_factory=dict)  # trace id -> way
    alone_ms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    # Untraced answers by (sender, way), one list per turn: for ratios paired by turn.
    by_turn: dict[tuple[str, str], list[list[float]]] = field(
        default_factory=lambda: defaultdict(list)
    )

    def keep(
        self, way: str, sender: str, answers: list[tuple[float, str | None]], turn: int
    ) -> None:
        turns = self.by_turn[(sender, way)]
        while len(turns) <= turn:
            turns.append([])
        turns[turn] += [took for took, trace_id in answers if trace_id is None]
        for took, trace_id in answers:
            if sender != OURS:
                self.others_ms[sender][way].append(took)
            elif trace_id is None:
                self.client_ms[way].append(took)
            else:
                self.traced[trace_id] = {"client": took}
                self.way_of[trace_id] = way


def steps_of(spans: Sequence[Received]) -> dict[str, float]:
    """One trace's steps in ms (those it has)."""
    named: dict[str, Received] = {}
    for span in spans:
        name = "request" if span.kind == 2 else span.name
        named.setdefault(name, span)
    out = {
        name: (span.end_ns - span.start_ns) / 1e6
        for name, span in named.items()
        if name in {label for label, _ in STEPS}
    }
    batch, queue, encode = named.get("batch"), named.get("queue"), named.get("encode")
    broker = named.get("broker")
    if batch is not None and queue is not None:
        out["hand-off"] = (batch.start_ns - queue.end_ns) / 1e6
    elif batch is not None and broker is not None:
        out["hand-off"] = (batch.start_ns - broker.start_ns) / 1e6
    if batch is not None and encode is not None:
        out["way back"] = (encode.start_ns - batch.end_ns) / 1e6
    return out


@dataclass
class Breakdown:
    """The p50 of every step, by way, and the model and decoder alone."""

    steps: dict[str, dict[str, float]]  # way -> step -> p50 ms
    alone: dict[str, float]  # "model", "decode" -> p50 ms
    serving: str
    requests: dict[str, int]
    others: dict[str, dict[str, float]] = field(default_factory=dict)  # sender -> way -> p50
    # sender -> way -> the median over turns of (its p50 / ours) in that turn
    paired: dict[str, dict[str, float]] = field(default_factory=dict)
    # sender -> way -> the median over turns of (its p50 - ours) in that turn, ms
    added: dict[str, dict[str, float]] = field(default_factory=dict)
    # With a baseline: clients -> (ours, before) images/s and the median of the rounds' ratios
    throughput: dict[int, tuple[float, float, float]] = field(default_factory=dict)

    @property
    def plain(self) -> dict[str, float]:
        return self.others.get(PLAIN, {})

    @property
    def vs_plain_bound(self) -> float:
        return VS_PLAIN_BF16 if "bf16" in self.serving else 1.0

    def verdicts(self) -> list[str]:
        both = self.alone["model"] + self.alone["decode"]
        lines = []
        for way in (CLOSED, IDLE):  # the target is the closed loop's; after idle, for the record
            client = self.steps[way].get("client", float("nan"))
            bound = both + ADDED_MS
            verdict = ("ok" if client <= bound else "MISS") if way == CLOSED else "info"
            lines.append(
                f"lone p50 {way}: {client:.2f} ms against model + decode alone {both:.2f} "
                f"+ {ADDED_MS:.1f} = {bound:.2f} ms (+{client - both:.2f} ms), {verdict}"
            )
        batch = self.steps[CLOSED].get("batch", float("nan"))
        ratio = batch / both
        lines.append(
            f"worker per lone image (batch span, closed loop) {batch:.2f} ms / model + decode "
            f"alone {both:.2f} ms = x{ratio:.2f} (target <= x{WORKER_RATIO}), "
            + ("ok" if ratio <= WORKER_RATIO else "MISS")
        )
        for way in (CLOSED, IDLE) if BEFORE in self.others else ():
            ours, before = self.steps[way]["client"], self.others[BEFORE][way]
            lines.append(
                f"{way}: ours {ours:.2f} ms, before {before:.2f} ms; before / ours, median of "
                f"the turns' ratios: x{self.paired[BEFORE][way]:.2f}"
            )
        for way in (CLOSED, IDLE) if BROKER in self.others else ():
            ours, theirs = self.steps[way]["client"], self.others[BROKER][way]
            added = self.added[BROKER][way]
            verdict = ("ok" if added <= BROKER_ADDED_MS else "MISS") if way == CLOSED else "info"
            lines.append(
                f"broker mode {way}: {theirs:.2f} ms against in-process {ours:.2f} ms; median of "
                f"the turns' differences {added:+.2f} ms (target <= +{BROKER_ADDED_MS:.1f}), "
                + verdict
            )
        for clients, (ours_rate, before_rate, ratio) in self.throughput.items():
            lines.append(
                f"throughput @{clients}: ours {ours_rate:.1f} img/s, before {before_rate:.1f}; "
                f"ours / before, median of the rounds' ratios: x{ratio:.2f} (target >= "
                f"x{VS_BEFORE_THROUGHPUT}), " + ("ok" if ratio >= VS_BEFORE_THROUGHPUT else "MISS")
            )
        for way in (CLOSED, IDLE) if self.plain else ():
            ours, theirs = self.steps[way]["client"], self.plain[way]
            bound, ratio = self.vs_plain_bound, self.paired[PLAIN][way]
            verdict = ("ok" if ratio >= bound else "MISS") if way == IDLE else "info"
            lines.append(
                f"{way}: ours {ours:.2f} ms, {PLAIN} {theirs:.2f} ms; theirs / ours, median of "
                f"the turns' ratios: x{ratio:.2f}"
                + (f" (target >= x{bound})" if way == IDLE else "")
                + f", {verdict}"
            )
        return lines

    def table(self) -> list[str]:
        lines = [
            f"{'step':<12} {CLOSED:>12} {IDLE:>12}   what",
            *(
                f"{label:<12} "
                + " ".join(
                    f"{self.steps[way].get(label, float('nan')):12.2f}" for way in (CLOSED, IDLE)
                )
                + f"   {what}"
                for label, what in STEPS
            ),
            f"{'alone':<12} model {self.alone['model']:.2f} ms ({self.serving}, batch 1, with its "
            f"head and top-k), decode {self.alone['decode']:.2f} ms (one thread)",
        ]
        what = {
            PLAIN: "the plain FastAPI + OpenVINO app at the client, in the same turns",
            BEFORE: "the baseline commit's server at the client, in the same turns",
            BROKER: "this server in broker mode at the client, in the same turns",
        }
        for sender, p50 in self.others.items():
            lines.insert(
                2,
                f"{sender:<12} "
                + " ".join(f"{p50.get(way, float('nan')):12.2f}" for way in (CLOSED, IDLE))
                + f"   {what[sender]}",
            )
        return lines


def complete(spans: list[Received], trace_id: str) -> bool:
    names = {s.name for s in spans if s.trace_id == trace_id}
    return {"batch", "model", "encode"} <= names


def summarise(sample: Sample, spans: list[Received], serving: str) -> Breakdown:
    by_trace: dict[str, list[Received]] = defaultdict(list)
    for span in spans:
        by_trace[span.trace_id].append(span)
    per_way: dict[str, dict[str, list[float]]] = {
        CLOSED: defaultdict(list),
        IDLE: defaultdict(list),
    }
    for trace_id, measured in sample.traced.items():
        steps = steps_of(by_trace[trace_id])
        if "request" in steps:
            steps["outside"] = measured["client"] - steps["request"]
        for step, ms in steps.items():
            per_way[sample.way_of[trace_id]][step].append(ms)
    for way, values in sample.client_ms.items():
        per_way[way]["client"] = values
    p50 = {
        way: {step: statistics.median(values) for step, values in steps.items() if values}
        for way, steps in per_way.items()
    }
    alone = {label: statistics.median(values) for label, values in sample.alone_ms.items()}
    counts = {way: len(sample.client_ms[way]) for way in (CLOSED, IDLE)}
    others = {
        sender: {way: statistics.median(values) for way, values in ways.items() if values}
        for sender, ways in sample.others_ms.items()
    }
    paired = {
        sender: {way: _paired(sample, sender, way) for way in (CLOSED, IDLE)} for sender in others
    }
    added = {
        sender: {
            way: _paired(sample, sender, way, lambda theirs, ours: theirs - ours)
            for way in (CLOSED, IDLE)
        }
        for sender in others
    }
    return Breakdown(p50, alone, serving, counts, others, paired, added)


def _paired(
    sample: Sample,
    sender: str,
    way: str,
    compare: Callable[[float, float], float] = lambda theirs, ours: theirs / ours,
) -> float:
    """The median over turns of ``compare(sender's p50, ours)`` in the same turn (default:
    their ratio)."""
    values = [
        compare(statistics.median(theirs), statistics.median(ours))
        for theirs, ours in zip(
            sample.by_turn[(sender, way)], sample.by_turn[(OURS, way)], strict=True
        )
        if theirs and ours
    ]
    return statistics.median(values) if values else float("nan")
