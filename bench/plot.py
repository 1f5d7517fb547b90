"""The benchmark's figure: throughput and latency against concurrency, one row per model."""

from __future__ import annotations

from pathlib import Path

from bench.results import ModelReport


def write_plot(reports: list[ModelReport], path: Path) -> None:
    """Draw every system of every report to a PNG at ``path`` (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(reports), 2, figsize=(12, 4.2 * len(reports)), squeeze=False)
    for row, report in enumerate(reports):
        systems = list(dict.fromkeys(p.system for p in report.points))
        tput, lat = axes[row]
        for system in systems:
            pts = [p for p in report.points if p.system == system]
            xs = [p.clients for p in pts]
            tput.plot(xs, [p.images_per_s for p in pts], marker="o", label=system)
            (line,) = lat.plot(xs, [p.p50_ms for p in pts], marker="o", label=f"{system} p50")
            lat.plot(
                xs,
                [p.p99_ms for p in pts],
                marker="x",
                linestyle="--",
                color=line.get_color(),
                label=f"{system} p99",
            )
        tput.axhline(
            report.best_raw(), color="grey", linestyle=":", label="raw pipeline, best batch"
        )
        tput.set(
            title=f"{report.model}: throughput",
            xlabel="concurrent clients",
            ylabel="images/s",
            xscale="log",
        )
        lat.set(
            title=f"{report.model}: latency",
            xlabel="concurrent clients",
            ylabel="ms",
            xscale="log",
            yscale="log",
        )
        tput.legend(fontsize=8)
        lat.legend(fontsize=7, ncol=2)
        for axis in (tput, lat):
            axis.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
