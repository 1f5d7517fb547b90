"""The benchmark's verdicts: which systems they compare, and against what."""

from __future__ import annotations

from app.bench.__main__ import ModelReport, Point, ratios


def _point(system: str, clients: int, images_per_s: float, p50_ms: float) -> Point:
    return Point(system, clients, images_per_s, p50_ms, 2 * p50_ms, 1.0, 0, 5.0)


def test_the_target_at_8_clients_is_shown_against_the_raw_pipeline_at_batch_8() -> None:
    report = ModelReport("resnet50", raw={1: (14.0, 70.0), 8: (18.0, 440.0), 32: (19.5, 1600.0)})
    report.points = [_point("ours", 8, 17.0, 480.0), _point("service-streamer", 8, 15.0, 500.0)]
    lines = ratios([report], {})
    assert lines == [
        "resnet50: ours vs service-streamer @8: throughput x1.13 (>= 1.3), p50 x0.96 (<= 1.0)"
        "  MISS",
        "resnet50: bound @8: 8 clients make batches of at most 8, and the raw pipeline at "
        "batch 8 makes 18.0 img/s = x1.20 service-streamer's",
    ]


def test_machinery_ratio_takes_this_servers_best_and_reports_the_decoding_reference() -> None:
    mach = {
        "noop_rps": 2000.0,
        "decoding_rps": 1900.0,  # faster than ours here: must not be taken for ours
        "ours_rps": 700.0,
        "ours-wdec_rps": 1000.0,
        "ceiling_rps": 1500.0,
    }
    lines = ratios([], mach)
    assert lines[0] == (
        "machinery: passthrough model (ours-wdec) 1000 req/s / bare FastAPI upload 2000 req/s"
        " = 0.50  (target >= 0.70)  MISS"
    )
    assert "also decodes each upload 1900 req/s = 0.95 of the bare endpoint" in lines[1]
    assert lines[2].endswith("would reach 0.75; this server reached 0.67 of it")
