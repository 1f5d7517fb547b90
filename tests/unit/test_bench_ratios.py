"""The benchmark's verdicts: which systems they compare, and against what."""

from __future__ import annotations

import pytest

from bench.results import PREDICT, V2_GRPC, V2_HTTP, ModelReport, Point, ProtocolReport
from bench.targets import TARGETS, Metric, Target, target
from bench.verdicts import ratios


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
        "ours-2w_rps": 1000.0,
        "ceiling_rps": 1500.0,
    }
    lines = ratios([], mach)
    assert lines[0] == (
        "machinery: passthrough model (ours-2w) 1000 req/s / bare FastAPI upload 2000 req/s"
        " = 0.50 (the bare endpoint decodes nothing: judged by the ceiling below)"
    )
    assert "also decodes each upload 1900 req/s = 0.95 of the bare endpoint" in lines[1]
    assert lines[2].endswith(
        "would reach 0.75; this server reached 0.67 of it  (target >= 0.70)  MISS"
    )
    assert len(lines) == 3  # no baseline, decode or HTTP figures: no lines for them


def test_the_cpu_outside_the_model_is_judged_against_issue_28s_targets() -> None:
    mach = {
        "noop_rps": 2000.0,
        "ours_rps": 1300.0,
        "before_rps": 500.0,
        "ceiling_rps": 1700.0,
        "decode_ms": 0.61,
        "decode_pillow_ms": 1.25,
        "ours_http_cpu_ms": 0.31,
        "before_http_cpu_ms": 2.1,
    }
    lines = ratios([], mach)
    assert lines[1].endswith("this server reached 0.76 of it  (target >= 0.70)  PASS")
    assert lines[2] == (
        "machinery vs before: passthrough model, default settings, 1300 req/s / the baseline's"
        " 500 = x2.60  (target >= x1.6)  PASS"
    )
    assert lines[3] == (
        "decode: 0.61 ms CPU per bench photo (the workers' decoder; Pillow's 1.25 ms)"
        "  (target <= 1.2 ms)  PASS"
    )
    assert lines[4] == (
        "HTTP process: 0.31 ms CPU per request at 64 clients, default settings (the baseline's:"
        " 2.10 ms)  (target <= 0.25 ms)  MISS"
    )


def test_a_configuration_is_judged_against_the_same_one_served_by_the_baseline() -> None:
    report = ModelReport("efficientnet_lite0", raw={1: (70.0, 14.0)})
    report.points = [
        _point("ours+openvino+int8", 64, 440.0, 140.0),
        _point("before+openvino+int8", 64, 380.0, 165.0),
        _point("ours", 64, 100.0, 600.0),
        _point("before", 64, 102.0, 590.0),
    ]
    report.vs_before_p50 = {"ours+openvino+int8": (5.6, 7.0), "ours": (14.2, 14.0)}
    lines = [line for line in ratios([report], {}) if "vs before" in line]
    assert lines == [
        "efficientnet_lite0: ours+openvino+int8 vs before: @64 x1.16  (target >= x1.15)  PASS;"
        " lone p50 in turns 5.6 / 7.0 ms = 0.80  (target <= 1)  PASS",
        "efficientnet_lite0: ours vs before: @64 x0.98  (target >= x1)  MISS;"
        " lone p50 in turns 14.2 / 14.0 ms = 1.01  (target <= 1)  MISS",
    ]


def test_saturation_and_idle_lines_read_their_targets_from_the_table() -> None:
    report = ModelReport("resnet50", raw={1: (14.0, 70.0), 32: (20.0, 1600.0)})
    report.points = [_point("ours", 64, 18.5, 3400.0)]
    report.idle = {"ours": (77.0, 70.0)}
    assert ratios([report], {}) == [
        "resnet50: saturation (ours@64 / raw best) = 0.93  (target >= 0.90)  PASS",
        "resnet50: idle latency of ours (p50@1 / raw single, in turns) = 1.10, +7.0 ms"
        "  (target <= 1.10 and <= 5 ms)  MISS",
    ]
    report.model = "efficientnet_lite0"
    assert ratios([report], {})[0] == (
        "efficientnet_lite0: saturation (ours@64 / raw best) = 0.93  (target >= 0.80)  PASS"
    )


def test_targets_table_picks_the_most_specific_row_and_falls_back_to_the_default() -> None:
    assert target(Metric.SATURATION, "resnet50", clients=64).bound == 0.90
    assert target(Metric.SATURATION, "efficientnet_lite0", clients=64).bound == 0.80
    assert target(Metric.SATURATION, "some_new_model", clients=64).bound == 0.80
    assert target(Metric.VS_STREAMER_THROUGHPUT, "resnet50", clients=8).bound == 1.3
    assert target(Metric.VS_STREAMER_THROUGHPUT, "resnet50", clients=64).bound == 1.0
    assert target(Metric.VS_STREAMER_P50, "efficientnet_lite0", clients=1).bound == 0.5
    assert target(Metric.VS_STREAMER_P50, "efficientnet_lite0", clients=8).bound == 1.0
    assert target(Metric.VS_STREAMER_P50, "resnet50", clients=1).bound == 1.0
    assert target(Metric.IDLE_RATIO, "resnet50", clients=1).bound == 1.10
    assert target(Metric.IDLE_ADDED_MS, "some_new_model", clients=1).bound == 5.0
    assert target(Metric.CEILING_SHARE).bound == 0.70


def test_every_metric_has_a_default_row_and_no_two_rows_collide() -> None:
    for metric in Metric:
        default = target(metric)
        assert (default.model, default.clients, default.runtime) == (None, None, None), metric
    keys = [(row.metric, row.model, row.clients, row.runtime) for row in TARGETS]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize(
    ("row", "value", "met"),
    [
        (Target(Metric.SATURATION, 0.80), 0.80, True),
        (Target(Metric.SATURATION, 0.80), 0.79, False),
        (Target(Metric.VS_STREAMER_P50, 1.0), 1.0, True),
        (Target(Metric.VS_STREAMER_P50, 1.0), 1.01, False),
        (Target(Metric.IDLE_ADDED_MS, 5.0), -3.0, True),
    ],
)
def test_a_target_is_met_at_its_bound_in_the_direction_of_its_metric(
    row: Target, value: float, met: bool
) -> None:
    assert row.met(value) is met


def test_another_runtime_is_judged_against_its_own_raw_loop_not_torchscripts() -> None:
    report = ModelReport("efficientnet_lite0", raw={1: (70.0, 14.0), 8: (80.0, 100.0)})
    report.raw_runtimes = {
        "openvino": {1: (130.0, 7.7), 8: (160.0, 50.0)},
        "openvino+int8": {1: (300.0, 3.3), 8: (400.0, 20.0)},
    }
    report.points = [
        _point("ours", 64, 76.0, 800.0),
        _point("ours+openvino", 64, 152.0, 400.0),
        _point("ours+openvino+int8", 64, 180.0, 300.0),
        _point("ours", 1, 70.0, 14.0),
        _point("ours+openvino", 1, 100.0, 10.0),
    ]
    lines = ratios([report], {})
    # The TorchScript saturation ignores ours+openvino (which beats the TorchScript loop).
    assert lines[0].startswith("efficientnet_lite0: saturation (ours@64 / raw best) = 0.95")
    # Each runtime against its own raw loop, its gain against its own target (x1.5 for
    # OpenVINO fp32, x2.5 for int8), and a lone request's p50 against TorchScript's.
    assert lines[1] == (
        "efficientnet_lite0: ours+openvino@64 / its own raw best = 0.95  (target >= 0.90)  PASS;"
        " vs ours (TorchScript fp32)@64 = x2.00  (target >= x1.5)  PASS; p50@1 / ours' = 0.71"
        " (target <= 1)  PASS"
    )
    assert lines[2] == (
        "efficientnet_lite0: ours+openvino+int8@64 / its own raw best = 0.45  (target >= 0.90)"
        "  MISS; vs ours (TorchScript fp32)@64 = x2.37  (target >= x2.5)  MISS"
    )


def test_the_default_server_is_judged_against_the_plain_openvino_app_by_the_cpu() -> None:
    report = ModelReport("efficientnet_lite0", raw={1: (100.0, 10.0)})
    for clients, ours, theirs in ((1, 180.0, 140.0), (8, 230.0, 130.0)):
        report.points += [_point("ours-default", clients, ours, 5.0)]
        report.points += [_point("openvino-plain", clients, theirs, 7.0)]
    for point in report.points:
        point.serving = "openvino+bf16" if point.system == "ours-default" else ""
    report.vs_plain_p50 = (5.0, 7.5, 1.4)  # at 1 client: the turns' ratio, not the rates
    report.lone = ["lone p50 closed loop: 5.00 ms ... ok"]
    report.bf16_cpu = True
    lines = [line for line in ratios([report], {}) if "plain FastAPI" in line]
    assert lines == [
        "efficientnet_lite0: ours-default (openvino+bf16) vs plain FastAPI + OpenVINO defaults "
        "@1: x1.40 (lone p50s after a second of idle, in turns)  (target >= x1.3 on a bf16 CPU)"
        "  PASS",
        "efficientnet_lite0: ours-default (openvino+bf16) vs plain FastAPI + OpenVINO defaults "
        "@8: x1.77 (throughput)  (target >= x1.3 on a bf16 CPU)  PASS",
    ]
    assert "efficientnet_lite0: lone p50 closed loop: 5.00 ms ... ok" in ratios([report], {})
    report.bf16_cpu = False  # both compute fp32 there: never behind is the bar
    assert "(target >= x1)  PASS" in next(
        line for line in ratios([report], {}) if "@8: x1.77" in line
    )


def test_the_v2_protocol_is_judged_by_the_median_of_its_ratios_to_predict_round_by_round() -> None:
    # Round 2 ran while the machine was slow for every way: each round is a ratio of its own
    # (grpc at 8: 0.50, 1.00, 0.29), and the verdict takes their median.
    report = ProtocolReport(
        "efficientnet_lite0",
        rounds={
            PREDICT: {1: [100.0, 50.0, 110.0], 8: [200.0, 80.0, 210.0]},
            V2_HTTP: {1: [98.0, 49.0, 103.0], 8: [210.0, 84.0, 212.0]},
            V2_GRPC: {1: [120.0, 60.0, 140.0], 8: [100.0, 80.0, 60.0]},
        },
    )
    assert ratios([], {}, report) == [
        "efficientnet_lite0: protocols @1: v2 http x0.98, v2 grpc x1.20 of /predict/tag's "
        "images/s (median of 3 rounds in turns)  (target >= x0.95)  PASS",
        "efficientnet_lite0: protocols @8: v2 http x1.05, v2 grpc x0.50 of /predict/tag's "
        "images/s (median of 3 rounds in turns)  (target >= x0.95)  MISS",
    ]
    del report.rounds[V2_GRPC]  # a way that was not measured is no pass
    assert ratios([], {}, report)[0].endswith(
        "v2 http x0.98 of /predict/tag's images/s "
        "(median of 3 rounds in turns)  (target >= x0.95)  MISS"
    )
