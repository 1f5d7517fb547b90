"""The benchmark's verdicts: the ratios the project's targets are stated in, each with its
target from :mod:`bench.targets` and PASS or MISS, one printable line each."""

from __future__ import annotations

from bench.results import MACHINERY_SYSTEMS, PREDICT, V2_GRPC, V2_HTTP, ModelReport, ProtocolReport
from bench.targets import Metric, target


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def ratios(
    reports: list[ModelReport],
    mach: dict[str, float],
    protocols: ProtocolReport | None = None,
) -> list[str]:
    """One line per ratio, for every model in ``reports``, the machinery step ``mach``
    (either may be empty) and the protocols step, where it ran."""
    lines = []
    for report in reports:
        m = report.model
        best_raw = report.best_raw()
        # TorchScript configurations against the TorchScript raw loop; other runtimes below.
        ours64 = [
            p
            for p in report.points
            if p.system.startswith("ours")
            and "+" not in p.system
            and p.serving in ("", "torchscript")
            and p.clients == 64
        ]
        at64 = max(ours64, key=lambda p: p.images_per_s, default=None)
        saturation = target(Metric.SATURATION, m, clients=64)
        if at64:
            r = at64.images_per_s / best_raw
            lines.append(
                f"{m}: saturation ({at64.system}@64 / raw best) = {r:.2f}  "
                f"(target >= {saturation.bound:.2f})  {_verdict(saturation.met(r))}"
            )
        ours_ts = report.point("ours", 64)
        own_target = target(Metric.RUNTIME_SATURATION, m, clients=64)
        for runtime in report.raw_runtimes:
            with_runtime = report.point(f"ours+{runtime}", 64)
            if with_runtime is None or ours_ts is None:
                continue
            own = with_runtime.images_per_s / report.best_raw(runtime)
            gain = with_runtime.images_per_s / ours_ts.images_per_s
            line = (
                f"{m}: ours+{runtime}@64 / its own raw best = {own:.2f}  "
                f"(target >= {own_target.bound:.2f})  {_verdict(own_target.met(own))}; "
                f"vs ours (TorchScript fp32)@64 = x{gain:.2f}"
            )
            need = target(Metric.RUNTIME_GAIN, m, 64, runtime)
            line += f"  (target >= x{need.bound:g})  {_verdict(need.met(gain))}"
            lone, ours_lone = report.point(f"ours+{runtime}", 1), report.point("ours", 1)
            if lone is not None and ours_lone is not None:
                idle = target(Metric.RUNTIME_IDLE, m, 1, runtime)
                r = lone.p50_ms / ours_lone.p50_ms
                line += (
                    f"; p50@1 / ours' = {r:.2f} (target <= {idle.bound:g})  {_verdict(idle.met(r))}"
                )
            lines.append(line)
        idle_ratio = target(Metric.IDLE_RATIO, m, clients=1)
        idle_added = target(Metric.IDLE_ADDED_MS, m, clients=1)
        for label, (served, alone) in report.idle.items():
            r, added = served / alone, served - alone
            lines.append(
                f"{m}: idle latency of {label} (p50@1 / raw single, in turns) = {r:.2f}, "
                f"+{added:.1f} ms  (target <= {idle_ratio.bound:.2f} and "
                f"<= {idle_added.bound:g} ms)  "
                f"{_verdict(idle_ratio.met(r) and idle_added.met(added))}"
            )
        for label in dict.fromkeys(p.system for p in report.points if p.system.startswith("ours")):
            for clients in sorted({p.clients for p in report.points}):
                ours = report.point(label, clients)
                theirs = report.point("service-streamer", clients)
                if not (ours and theirs):
                    continue
                tput = ours.images_per_s / theirs.images_per_s
                lat = ours.p50_ms / theirs.p50_ms
                need_tput = target(Metric.VS_STREAMER_THROUGHPUT, m, clients)
                need_lat = target(Metric.VS_STREAMER_P50, m, clients)
                ok = need_tput.met(tput) and need_lat.met(lat)
                lines.append(
                    f"{m}: {label} vs service-streamer @{clients}: throughput x{tput:.2f} "
                    f"(>= {need_tput.bound}), p50 x{lat:.2f} (<= {need_lat.bound})  "
                    f"{_verdict(ok)}"
                )
        lines += _vs_plain(report)
        lines += [f"{m}: {line}" for line in report.lone]
        for label, (ours_p50, before_p50) in report.vs_before_p50.items():
            lines.append(_vs_before(report, label, ours_p50, before_p50))
        theirs8 = report.point("service-streamer", 8)
        if theirs8 and 8 in report.raw:
            # 8 clients never make a batch above 8: how far the target at 8 clients is from what
            # the model itself can do at that size.
            raw8 = report.raw[8][0]
            lines.append(
                f"{m}: bound @8: 8 clients make batches of at most 8, and the raw pipeline at "
                f"batch 8 makes {raw8:.1f} img/s = x{raw8 / theirs8.images_per_s:.2f} "
                "service-streamer's"
            )
    if mach:
        lines += _machinery(mach)
    if protocols is not None:
        lines += protocol_ratios(protocols)
    return lines


def protocol_ratios(report: ProtocolReport) -> list[str]:
    """Per concurrency: the v2 protocol's images/s over HTTP and over gRPC against
    /predict/tag's, each the median of the rounds' ratios; PASS where both meet the bound."""
    need = target(Metric.VS_PREDICT, report.model)
    lines = []
    for clients in sorted(report.rounds.get(PREDICT, {})):
        found = {way: report.ratio(way, clients) for way in (V2_HTTP, V2_GRPC)}
        shown = {way: r for way, r in found.items() if r is not None}
        if not shown:
            continue
        rounds = len(report.rounds[PREDICT][clients])
        lines.append(
            f"{report.model}: protocols @{clients}: "
            + ", ".join(f"{way} x{r:.2f}" for way, r in shown.items())
            + f" of {PREDICT}'s images/s (median of {rounds} rounds in turns)  "
            f"(target >= x{need.bound:g})  "
            f"{_verdict(len(shown) == len(found) and all(map(need.met, shown.values())))}"
        )
    return lines


def _machinery(mach: dict[str, float]) -> list[str]:
    measured = [
        label for label, kind, *_ in MACHINERY_SYSTEMS if kind == "ours" and f"{label}_rps" in mach
    ]
    best = max(measured, key=lambda label: mach[f"{label}_rps"])
    r = mach[f"{best}_rps"] / mach["noop_rps"]
    lines = [
        f"machinery: passthrough model ({best}) {mach[f'{best}_rps']:.0f} req/s / bare "
        f"FastAPI upload {mach['noop_rps']:.0f} req/s = {r:.2f} (the bare endpoint decodes "
        "nothing: judged by the ceiling below)"
    ]
    if "decoding_rps" in mach:
        lines.append(
            "machinery reference: the bare endpoint that also decodes each upload "
            f"{mach['decoding_rps']:.0f} req/s = {mach['decoding_rps'] / mach['noop_rps']:.2f} "
            "of the bare endpoint"
        )
    if "ceiling_rps" in mach:
        share = mach[f"{best}_rps"] / mach["ceiling_rps"]
        need = target(Metric.CEILING_SHARE)
        lines.append(
            "machinery ceiling: a server that decoded and otherwise cost no more than the "
            f"bare endpoint would reach {mach['ceiling_rps'] / mach['noop_rps']:.2f}; "
            f"this server reached {share:.2f} of it  (target >= {need.bound:.2f})  "
            f"{_verdict(need.met(share))}"
        )
    if "before_rps" in mach:
        gain = mach["ours_rps"] / mach["before_rps"]
        need = target(Metric.VS_BEFORE, "passthrough", 64)
        lines.append(
            f"machinery vs before: passthrough model, default settings, {mach['ours_rps']:.0f} "
            f"req/s / the baseline's {mach['before_rps']:.0f} = x{gain:.2f}  "
            f"(target >= x{need.bound:g})  {_verdict(need.met(gain))}"
        )
    if "decode_ms" in mach:
        need = target(Metric.DECODE_MS)
        lines.append(
            f"decode: {mach['decode_ms']:.2f} ms CPU per bench photo (the workers' decoder; "
            f"Pillow's {mach['decode_pillow_ms']:.2f} ms)  (target <= {need.bound:g} ms)  "
            f"{_verdict(need.met(mach['decode_ms']))}"
        )
    if "ours_http_cpu_ms" in mach:
        need = target(Metric.HTTP_MS)
        http = mach["ours_http_cpu_ms"]
        before = (
            f" (the baseline's: {mach['before_http_cpu_ms']:.2f} ms)"
            if "before_http_cpu_ms" in mach
            else ""
        )
        lines.append(
            f"HTTP process: {http:.2f} ms CPU per request at 64 clients, default settings"
            f"{before}  (target <= {need.bound:g} ms)  {_verdict(need.met(http))}"
        )
    return lines


def _vs_before(report: ModelReport, label: str, ours_p50: float, before_p50: float) -> str:
    """``label`` against the same configuration served by the baseline commit."""
    runtime = label.partition("+")[2] or None
    line = f"{report.model}: {label} vs before"
    ours, before = report.point(label, 64), report.point("before" + label[len("ours") :], 64)
    if ours is not None and before is not None:
        gain = ours.images_per_s / before.images_per_s
        need = target(Metric.VS_BEFORE, report.model, 64, runtime)
        line += f": @64 x{gain:.2f}  (target >= x{need.bound:g})  {_verdict(need.met(gain))}"
    r = ours_p50 / before_p50
    need = target(Metric.P50_VS_BEFORE, report.model, 1, runtime)
    return line + (
        f"; lone p50 in turns {ours_p50:.1f} / {before_p50:.1f} ms = {r:.2f}  "
        f"(target <= {need.bound:g})  {_verdict(need.met(r))}"
    )


def _vs_plain(report: ModelReport) -> list[str]:
    """This server with its defaults against the plain OpenVINO app, at each concurrency
    (at 1 client by the lone p50s measured in turns, where they were)."""
    lines = []
    need = target(Metric.VS_PLAIN, report.model, runtime="bf16" if report.bf16_cpu else None)
    for clients in sorted({p.clients for p in report.points}):
        ours, theirs = (
            report.point("ours-default", clients),
            report.point("openvino-plain", clients),
        )
        if ours is None or theirs is None:
            continue
        r = ours.images_per_s / theirs.images_per_s
        how = "throughput"
        if clients == 1 and report.vs_plain_p50 is not None:
            r, how = report.vs_plain_p50[2], "lone p50s after a second of idle, in turns"
        lines.append(
            f"{report.model}: ours-default ({ours.serving}) vs plain FastAPI + OpenVINO "
            f"defaults @{clients}: x{r:.2f} ({how})  (target >= x{need.bound:g}"
            f"{' on a bf16 CPU' if report.bf16_cpu else ''})  {_verdict(need.met(r))}"
        )
    return lines
