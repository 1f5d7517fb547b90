"""``bench.breakdown``, the arithmetic of ``bench.lone``: a lone request's steps from its
trace, the p50s by way, the ratios paired by turn, and the verdicts against the model and
decoder alone."""

from __future__ import annotations

from bench.breakdown import BEFORE, CLOSED, IDLE, OURS, PLAIN, Sample, steps_of, summarise
from tests.otlp import Received

MS = 1_000_000


def span(name: str, start_ms: float, end_ms: float, trace: str = "t1", kind: int = 1) -> Received:
    return Received(
        name=name, trace_id=trace, span_id=name, parent_id="", kind=kind, attributes={},
        links=(), status=0, service="", start_ns=int(start_ms * MS), end_ns=int(end_ms * MS),
    )  # fmt: skip


def trace(trace_id: str) -> list[Received]:
    """One in-process request: 6 ms in the server, its worker's batch from 1.5 to 5.5 ms."""
    return [
        span("POST /predict/tag", 0.0, 6.0, trace_id, kind=2),
        span("read upload", 0.1, 0.3, trace_id),
        span("admission", 0.05, 0.08, trace_id),
        span("queue", 0.4, 0.5, trace_id),
        span("batch", 0.9, 5.4, trace_id),
        span("decode", 1.0, 2.2, trace_id),
        span("model", 2.2, 5.4, trace_id),
        span("encode", 5.8, 5.85, trace_id),
        span("reply", 5.9, 6.0, trace_id),
    ]


def test_a_traces_steps_include_the_gaps_between_processes() -> None:
    steps = steps_of(trace("t1"))
    assert steps["request"] == 6.0 and steps["batch"] == 4.5
    assert round(steps["hand-off"], 6) == 0.4  # queue end to the worker's batch
    assert round(steps["way back"], 6) == 0.4  # batch end to the encoding
    broker = [s for s in trace("t2") if s.name != "queue"] + [span("broker", 0.45, 5.7, "t2")]
    assert round(steps_of(broker)["hand-off"], 6) == 0.45  # through Redis: from the entry


def test_the_breakdown_takes_p50s_by_way_and_judges_against_the_work_alone() -> None:
    sample = Sample()
    for turn, (ours, plain, before) in enumerate([(5.0, 8.0, 6.0), (7.0, 7.0, 7.0)]):
        sample.keep(CLOSED, OURS, [(ours, None)], turn)
        sample.keep(CLOSED, PLAIN, [(plain, None)], turn)
        sample.keep(CLOSED, BEFORE, [(before, None)], turn)
        sample.keep(IDLE, OURS, [(ours + 2, None)], turn)
        sample.keep(IDLE, PLAIN, [(plain + 4, None)], turn)
        sample.keep(IDLE, BEFORE, [(before + 2, None)], turn)
    sample.keep(CLOSED, OURS, [(6.2, "t1")], 0)
    sample.alone_ms = {"model": [3.0, 3.2], "decode": [1.0, 1.2]}  # p50s 3.1 and 1.1
    breakdown = summarise(sample, trace("t1"), "openvino+bf16")
    assert breakdown.steps[CLOSED]["client"] == 6.0  # the untraced ones: 5 and 7
    assert round(breakdown.steps[CLOSED]["outside"], 6) == 0.2  # 6.2 at the client - 6.0
    assert breakdown.paired[PLAIN][CLOSED] == (8 / 5 + 7 / 7) / 2  # ratios paired by turn
    assert breakdown.paired[PLAIN][IDLE] == (12 / 7 + 11 / 9) / 2
    verdicts = breakdown.verdicts()
    assert verdicts[0].startswith("lone p50 closed loop: 6.00 ms against model + decode alone")
    assert verdicts[0].endswith("4.20 + 1.0 = 5.20 ms (+1.80 ms), MISS")
    assert verdicts[1].endswith("info")  # after idle: for the record
    assert "x1.07 (target <= x1.15), ok" in verdicts[2]  # the batch: 4.5 / 4.2
    idle_vs_plain = next(v for v in verdicts if v.startswith("after idle: ours") and PLAIN in v)
    assert idle_vs_plain.endswith("(target >= x1.3), ok")  # bf16 serving: the 1.3 bar
    table = "\n".join(breakdown.table())
    assert "hand-off" in table and PLAIN in table and "before" in table
