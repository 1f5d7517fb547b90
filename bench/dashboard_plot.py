"""The Grafana dashboard's panels drawn with matplotlib, laid out as Grafana lays them out, from
the series ``bench.dashboard`` fetched from Prometheus.

What it honours of deploy/grafana/microbatch.json: each panel's ``gridPos`` (24 columns) and
title, the rows as headings, ``legendFormat`` for the legends, the field defaults ``unit``,
``min``, ``drawStyle`` (line or bars), ``fillOpacity``, ``lineInterpolation: stepAfter`` and
threshold lines, the ``byFrameRefID`` overrides that put a query on a right-hand axis with its
own unit, and the heatmap panel (``format: heatmap``: the cumulative ``le`` buckets taken apart
into one row of cells per bucket, zero cells left blank, an Oranges scale at exponent 0.5,
inverted on the dark theme as Grafana does).
Grafana's dark theme and classic palette, so the picture reads like the real thing.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from PIL import Image

Values = npt.NDArray[np.float64]

GRID_COLUMNS = 24
UNIT_IN = 0.36  # inches per gridPos height unit
WIDTH_IN = 16.0
HEADER_IN = 1.3  # the dashboard's title and the strip that names the load's phases
BACKGROUND, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
PALETTE = ("#73BF69", "#F2CC0C", "#8AB8FF", "#FF780A", "#F2495C", "#5794F2", "#B877D9",
           "#705DA0", "#37872D", "#FADE2A")  # fmt: skip
NAMED_COLOURS = {"green": "#73BF69", "red": "#F2495C", "yellow": "#FADE2A", "orange": "#FF780A"}
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


@dataclass(frozen=True)
class Series:
    """One series a panel query answered: its values on the common time grid (NaN where
    Prometheus had no sample, which breaks the line as ``spanNulls: false`` does)."""

    ref_id: str
    legend: str
    values: Values


@dataclass(frozen=True)
class PanelData:
    panel: Mapping[str, Any]
    series: list[Series]


@dataclass(frozen=True)
class PhaseSpan:
    """A stretch of the load, in seconds since it began."""

    name: str
    start_s: float
    end_s: float


def legend_text(legend_format: str, labels: Mapping[str, str]) -> str:
    """Grafana's ``{{label}}`` replaced by the series' label values; without a format, the
    labels as Prometheus prints them.

    >>> legend_text("{{model}} v{{version}}", {"model": "m", "version": "1"})
    'm v1'
    >>> legend_text("", {"__name__": "up", "job": "x"})
    'up{job="x"}'
    """
    if legend_format:
        return _LEGEND_LABEL.sub(lambda match: labels.get(match.group(1), ""), legend_format)
    name = labels.get("__name__", "")
    rest = ", ".join(f'{key}="{value}"' for key, value in labels.items() if key != "__name__")
    return f"{name}{{{rest}}}" if rest else name or "{}"


def field_unit(panel: Mapping[str, Any], ref_id: str) -> tuple[str, bool]:
    """The unit of ``ref_id``'s series, and whether they go on a right-hand axis."""
    config = panel.get("fieldConfig", {})
    unit, right = str(config.get("defaults", {}).get("unit") or "none"), False
    for override in config.get("overrides", []):
        matcher = override.get("matcher", {})
        if matcher.get("id") == "byFrameRefID" and matcher.get("options") == ref_id:
            for prop in override.get("properties", []):
                if prop["id"] == "unit":
                    unit = str(prop["value"])
                elif prop["id"] == "custom.axisPlacement":
                    right = prop["value"] == "right"
    return unit, right


def format_value(value: float, unit: str) -> str:
    """A tick label or a printed value in ``unit`` (Grafana's ``s``, ``bytes``, ``reqps``...).

    >>> format_value(0.0123, "s"), format_value(2.5, "s"), format_value(3 * 2**20, "bytes")
    ('12.3 ms', '2.5 s', '3 MiB')
    >>> format_value(1010 * 2**20, "bytes"), format_value(1312.4, "reqps")
    ('1010 MiB', '1312 req/s')
    """
    if value != value:  # NaN
        return "-"
    if unit == "s" and value:
        return f"{_short(value * 1000)} ms" if abs(value) < 1 else f"{_short(value)} s"
    if unit == "bytes":
        for size, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(value) >= size:
                return f"{_short(value / size)} {name}"
        return f"{value:.0f} B"
    suffix = " req/s" if unit == "reqps" else ""
    return f"{_short(value)}{suffix}"


def _short(value: float) -> str:
    """Three significant digits, but whole numbers from 1000 on (no exponent)."""
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _style_axes(ax: Any) -> None:
    ax.set_facecolor(PANEL)
    ax.tick_params(colors=TEXT, labelsize=7, length=2)
    ax.grid(True, color=GRID, linewidth=0.6)
    for side, spine in ax.spines.items():
        spine.set_visible(side == "bottom")
        spine.set_color(GRID)


def _phase_lines(ax: Any, phases: Sequence[PhaseSpan]) -> None:
    """A dotted line where each phase begins, and its number (as in the strip at the top)
    just above the plot."""
    for number, phase in enumerate(phases, 1):
        if number > 1:
            ax.axvline(phase.start_s, color="#8e8e8e", linewidth=0.6, linestyle=":", alpha=0.7)
        middle = (phase.start_s + phase.end_s) / 2
        ax.text(
            middle,
            1.01,
            str(number),
            transform=ax.get_xaxis_transform(),
            color="#8e8e8e",
            fontsize=6,
            ha="center",
            va="bottom",
        )


def _draw_timeseries(fig: Any, ax: Any, data: PanelData, times_s: Values) -> None:
    from matplotlib.ticker import FuncFormatter

    panel = data.panel
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    custom = defaults.get("custom", {})
    fill = float(custom.get("fillOpacity", 0)) / 100
    bars = custom.get("drawStyle") == "bars"
    steps = custom.get("lineInterpolation") == "stepAfter"
    axes: dict[bool, tuple[Any, str]] = {}
    handles = []
    for index, series in enumerate(data.series):
        unit, right = field_unit(panel, series.ref_id)
        if right not in axes:
            axes[right] = (ax.twinx() if right and axes else ax, unit)
            if right and axes[right][0] is not ax:
                axes[right][0].tick_params(colors=TEXT, labelsize=7, length=2)
                for spine in axes[right][0].spines.values():
                    spine.set_visible(False)
        target = axes[right][0]
        colour = PALETTE[index % len(PALETTE)]
        if bars:
            handle = target.bar(
                times_s, np.nan_to_num(series.values), width=0.8, color=colour, alpha=fill
            )
        else:
            (handle,) = target.plot(
                times_s,
                series.values,
                color=colour,
                linewidth=float(custom.get("lineWidth", 1)),
                drawstyle="steps-post" if steps else "default",
            )
            if fill:
                target.fill_between(
                    times_s, series.values, color=colour, alpha=fill, step="post" if steps else None
                )
        handle.set_label(series.legend)
        handles.append(handle)
    for step in defaults.get("thresholds", {}).get("steps", []):
        if custom.get("thresholdsStyle", {}).get("mode") == "line" and step["value"] is not None:
            colour = NAMED_COLOURS.get(step["color"], step["color"])
            ax.axhline(step["value"], color=colour, linewidth=0.9, linestyle="--")
    if not axes:
        axes[False] = (ax, str(defaults.get("unit") or "none"))
    for target, unit in axes.values():
        target.yaxis.set_major_formatter(FuncFormatter(lambda v, _, u=unit: format_value(v, u)))
        if defaults.get("min") == 0:
            target.set_ylim(bottom=0)
        low, high = target.get_ylim()
        if high - low < 1e-12:
            target.set_ylim(low, low + 1)
    if handles:
        # As many columns as the longest label allows (about 0.055 in a character at 7 pt).
        width_in = panel["gridPos"]["w"] / GRID_COLUMNS * WIDTH_IN - 0.6
        column_in = 0.45 + 0.055 * max(len(str(handle.get_label())) for handle in handles)
        ax.legend(
            handles=handles,
            loc="upper left",
            bbox_to_anchor=(0, -0.14),
            ncol=max(1, min(len(handles), int(width_in / column_in))),
            fontsize=7,
            frameon=False,
            labelcolor=TEXT,
            handlelength=1.2,
            columnspacing=1.0,
            borderaxespad=0,
        )


def _draw_heatmap(fig: Any, ax: Any, data: PanelData, times_s: Values, window: str) -> None:
    import matplotlib
    import matplotlib.colors as mcolors
    from matplotlib.ticker import FixedLocator

    options = data.panel.get("options", {})
    colour = options.get("color", {})
    buckets = sorted(data.series, key=lambda series: float(series.legend))
    cumulative = np.array([np.nan_to_num(series.values) for series in buckets])
    cells = np.diff(cumulative, axis=0, prepend=0.0).clip(min=0)
    shown = np.ma.masked_less_equal(cells, options.get("filterValues", {}).get("le", 1e-9))
    step = float(times_s[1] - times_s[0]) if len(times_s) > 1 else 1.0
    edges = np.append(times_s, times_s[-1] + step) - step / 2
    # Grafana inverts its sequential schemes (Oranges...) on the dark theme: high counts light.
    scheme = matplotlib.colormaps[colour.get("scheme", "Oranges")]
    if not colour.get("reverse", False):
        scheme = scheme.reversed()
    norm: mcolors.Normalize = mcolors.Normalize(vmin=0)
    if colour.get("scale") == "exponential":
        norm = mcolors.PowerNorm(gamma=float(colour.get("exponent", 0.5)), vmin=0)
    mesh = ax.pcolormesh(
        edges,
        np.arange(len(buckets) + 1),
        shown,
        cmap=scheme,
        norm=norm,
        edgecolors=PANEL,
        linewidth=float(options.get("cellGap", 0)) * 0.2,
    )
    ax.yaxis.set_major_locator(FixedLocator([index + 0.5 for index in range(len(buckets))]))
    ax.set_yticklabels([f"{float(series.legend):g}" for series in buckets])
    ax.set_ylabel("le", color=TEXT, fontsize=7)
    left, bottom, width, _ = ax.get_position().bounds
    scale = fig.add_axes((left, bottom - 0.016, width * 0.5, 0.004))
    bar = fig.colorbar(mesh, cax=scale, orientation="horizontal")
    bar.ax.tick_params(colors=TEXT, labelsize=6, length=2)
    bar.outline.set_visible(False)
    label = options.get("rowsFrame", {}).get("value", "count")
    bar.set_label(f"{label} per {window}, every {step:g} s", color=TEXT, fontsize=6, labelpad=1)


def draw(
    board: Mapping[str, Any],
    panels: Sequence[PanelData],
    times_s: Values,
    phases: Sequence[PhaseSpan],
    out: Path,
    *,
    subtitle: str,
    window: str = "rate interval",
    dpi: int = 90,
) -> None:
    """Write the dashboard to a PNG at ``out``: ``board``'s rows and panels where its grid
    puts them, each panel drawn from its :class:`PanelData` over ``times_s`` (seconds since
    the load began), the load's ``phases`` named along the top and marked in every panel.
    ``window``: what ``$__rate_interval`` was, for the heatmap's scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = {int(data.panel["id"]): data for data in panels}
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in board["panels"])
    height_in = HEADER_IN + rows * UNIT_IN
    fig = plt.figure(figsize=(WIDTH_IN, height_in), facecolor=BACKGROUND)

    def rect(x: float, y: float, w: float, h: float) -> tuple[float, float, float, float]:
        """Figure fractions of a box given in inches from the top left."""
        return (x / WIDTH_IN, 1 - (y + h) / height_in, w / WIDTH_IN, h / height_in)

    fig.text(
        0.01,
        1 - 0.3 / height_in,
        board.get("title", ""),
        color=TEXT,
        fontsize=14,
        fontweight="bold",
        va="center",
    )
    fig.text(
        0.99, 1 - 0.3 / height_in, subtitle, color="#8e8e8e", fontsize=8, va="center", ha="right"
    )
    end_s = float(times_s[-1]) if len(times_s) else 1.0
    strip = fig.add_axes(rect(0.55, 0.62, WIDTH_IN - 0.75, 0.36))
    strip.set_xlim(float(times_s[0]) if len(times_s) else 0.0, end_s)
    strip.set_axis_off()
    for index, phase in enumerate(phases):
        strip.axvspan(phase.start_s, phase.end_s, color=("#22252b", "#2a2e35")[index % 2])
        strip.text(
            (phase.start_s + phase.end_s) / 2,
            0.5,
            f"{index + 1}  {phase.name}",
            color=TEXT,
            fontsize=8,
            ha="center",
            va="center",
        )
    fig.text(
        0.55 / WIDTH_IN,
        1 - 0.55 / height_in,
        "load phases (numbered above each panel; x axes: seconds since the load began)",
        color="#8e8e8e",
        fontsize=7,
        va="center",
    )

    for panel in board["panels"]:
        grid = panel["gridPos"]
        x_in = grid["x"] / GRID_COLUMNS * WIDTH_IN
        y_in = HEADER_IN + grid["y"] * UNIT_IN
        w_in, h_in = grid["w"] / GRID_COLUMNS * WIDTH_IN, grid["h"] * UNIT_IN
        if panel["type"] == "row":
            left, middle = rect(x_in + 0.1, y_in, w_in, h_in)[0], rect(0, y_in, 0, h_in / 2)[1]
            fig.text(left, middle, panel["title"], color=TEXT, fontsize=11, fontweight="bold")
            continue
        data = drawn.get(int(panel["id"]), PanelData(panel, []))
        backdrop = fig.add_axes(rect(x_in + 0.05, y_in + 0.05, w_in - 0.1, h_in - 0.1))
        backdrop.set_facecolor(PANEL)
        backdrop.set_xticks([])
        backdrop.set_yticks([])
        for spine in backdrop.spines.values():
            spine.set_color(GRID)
        backdrop.set_title(panel["title"], loc="left", color=TEXT, fontsize=8.5, pad=-12, x=0.015)
        right = any(field_unit(panel, t["refId"])[1] for t in panel.get("targets", []))
        ax = fig.add_axes(
            rect(x_in + 0.75, y_in + 0.4, w_in - 0.95 - (0.6 if right else 0), h_in - 1.25)
        )
        _style_axes(ax)
        ax.set_xlim(float(times_s[0]) if len(times_s) else 0.0, end_s)
        _phase_lines(ax, phases)
        if not data.series:
            ax.text(
                0.5,
                0.5,
                "No data",
                transform=ax.transAxes,
                color="#8e8e8e",
                fontsize=11,
                ha="center",
                va="center",
            )
        elif panel["type"] == "heatmap":
            _draw_heatmap(fig, ax, data, times_s, window)
        else:
            _draw_timeseries(fig, ax, data, times_s)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, facecolor=BACKGROUND)
    plt.close(fig)
    # A palette of 256 colours: a third of the bytes, and nothing a reader would notice.
    Image.open(buffer).convert("RGB").quantize(256).save(out, optimize=True)
