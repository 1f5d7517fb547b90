"""The benchmark's machinery verdict: which systems it compares, and against what."""

from __future__ import annotations

from app.bench.__main__ import ratios


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
