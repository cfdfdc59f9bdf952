"""PNG plots of benchmark results (matplotlib, the `plot` extra), written beside the JSON.

Headless (the Agg backend): benchmarks run on servers and in CI.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter


def log_axis(ax: Axes, axis: str) -> None:
    """A log scale labelled in plain numbers (1, 10, 100), without minor-tick labels."""
    target = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    target.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    target.set_major_formatter(ScalarFormatter())
    target.set_minor_formatter(NullFormatter())


def plot_run(result: Mapping[str, Any], path: Path) -> None:
    """Latency CDF, latency over time and throughput over time of one run."""
    latencies = sorted(
        r["e2e"] * 1e3 for r in result["records"] if r["ok"] and r["e2e"] is not None
    )
    ttfts = sorted(r["ttft"] * 1e3 for r in result["records"] if r["ok"] and r["ttft"] is not None)
    series = result["timeseries"]
    fig, (cdf, over_time, rate) = plt.subplots(1, 3, figsize=(15, 4.2))
    for values, label in ((latencies, "end to end"), (ttfts, "TTFT")):
        if values:
            cdf.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
    cdf.set(xlabel="latency (ms)", ylabel="fraction of requests", title="Latency CDF")
    log_axis(cdf, "x")
    cdf.grid(True, alpha=0.3)
    cdf.legend()
    over_time.plot(series["t"], series["p50_ms"], label="p50")
    over_time.plot(series["t"], series["p99_ms"], label="p99")
    over_time.set(
        xlabel="send time (s)", ylabel="end-to-end latency (ms)", title="Latency over time"
    )
    over_time.grid(True, alpha=0.3)
    over_time.legend()
    rate.plot(series["t"], series["ok_per_s"], label="ok")
    rate.plot(series["t"], series["errors_per_s"], label="errors")
    rate.set(xlabel="send time (s)", ylabel="requests / s", title="Throughput over time")
    rate.grid(True, alpha=0.3)
    rate.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_sweep(result: Mapping[str, Any], path: Path) -> None:
    """Goodput and throughput against offered rate, and p50/p99 latency against rate."""
    runs = result["sweep"]
    rates = [run["rate"] for run in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(rates, rates, "k:", label="offered")
    left.plot(rates, [run["requests_per_s"] for run in runs], "o-", label="completed")
    if runs and runs[0]["goodput_per_s"] is not None:
        left.plot(rates, [run["goodput_per_s"] for run in runs], "s-", label="goodput (SLO met)")
    left.set(xlabel="offered rate (req/s)", ylabel="req/s", title="Goodput vs rate")
    left.grid(True, alpha=0.3)
    left.legend()
    for q in ("p50", "p99"):
        right.plot(rates, [run["latency_ms"]["e2e"][q] for run in runs], "o-", label=f"e2e {q}")
    right.set(xlabel="offered rate (req/s)", ylabel="ms", title="Latency vs rate")
    log_axis(right, "y")
    right.grid(True, alpha=0.3)
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_bars(
    title: str,
    groups: Sequence[str],
    series: Mapping[str, Sequence[float]],
    ylabel: str,
    path: Path,
    log: bool = False,
) -> None:
    """Grouped bars: one group per entry of `groups`, one bar per series."""
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(groups) * max(1, len(series)) / 2), 4.2))
    _bars(ax, groups, series)
    ax.set(ylabel=ylabel, title=title)
    if log:
        log_axis(ax, "y")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_bar_panels(
    panels: Mapping[str, tuple[Sequence[str], Mapping[str, Sequence[float]]]], path: Path
) -> None:
    """Grouped bars side by side, one panel per {title: (groups, {series: values})}."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    for ax, (title, (groups, series)) in zip(axes.flat, panels.items(), strict=True):
        _bars(ax, groups, series)
        ax.set(title=title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _bars(ax: Axes, groups: Sequence[str], series: Mapping[str, Sequence[float]]) -> None:
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks(range(len(groups)), groups)
    ax.grid(True, axis="y", alpha=0.3)


def plot_lines(
    title: str,
    xs: Sequence[float],
    series: Mapping[str, Sequence[float]],
    xlabel: str,
    ylabel: str,
    path: Path,
) -> None:
    plot_line_panels({title: series}, xs, xlabel, path, ylabel=ylabel)


def plot_line_panels(
    panels: Mapping[str, Mapping[str, Sequence[float]]],
    xs: Sequence[float],
    xlabel: str,
    path: Path,
    columns: int = 1,
    ylabel: str = "",
    ticks_at_xs: bool = False,
) -> None:
    """Line plots over the same `xs`, `columns` panels a row: {panel title: {series: ys}}."""
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(7 * columns, 4.2 * rows), squeeze=False)
    for ax, (title, series) in zip(axes.flat, panels.items(), strict=False):
        for label, values in series.items():
            ax.plot(xs, values, "o-", label=label)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
        if ticks_at_xs:
            ax.set_xticks(list(xs))
        ax.grid(True, alpha=0.3)
        ax.legend()
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
