"""PNG plots of benchmark results (matplotlib, headless Agg backend).

Every point is a median with its range drawn as an error bar, so a plot shows
the spread as the table does. A figure is one or more panels side by side,
each a bar chart or a line chart; benchmark modules describe their panels and
:func:`save_figure` draws them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks.stats import Spread

PANEL_WIDTH_IN: Final = 6.4
PANEL_HEIGHT_IN: Final = 4.4
DPI: Final = 110
CAPSIZE: Final = 4
HORIZONTAL_BAR_IN: Final = 0.4
"""Figure height given to each bar of a sideways bar chart."""
REFERENCE_COLOURS: Final = ("tab:red", "tab:green", "tab:orange", "tab:gray")


@dataclass(frozen=True)
class Bars:
    """A bar chart: one bar per label; optional horizontal reference lines (``label -> value``)."""

    title: str
    ylabel: str
    bars: Sequence[tuple[str, Spread]]
    references: Mapping[str, float] = field(default_factory=dict)
    log_y: bool = False
    horizontal: bool = False
    """Bars drawn sideways, for many bars or long labels."""


@dataclass(frozen=True)
class Lines:
    """A line chart: one line per series name, points ``(x, spread)``."""

    title: str
    xlabel: str
    ylabel: str
    lines: Mapping[str, Sequence[tuple[float, Spread]]]
    log_y: bool = False
    log_x: bool = False


Panel = Bars | Lines


def save_figure(path: Path, title: str, panels: Sequence[Panel], caption: str = "") -> Path:
    """Draw ``panels`` side by side under ``title`` (and a small ``caption``) into the PNG ``path``."""
    most_bars = max((len(panel.bars) for panel in panels if isinstance(panel, Bars) and panel.horizontal), default=0)
    height = max(PANEL_HEIGHT_IN, HORIZONTAL_BAR_IN * most_bars + 1.5)
    figure, axes = plt.subplots(1, len(panels), figsize=(PANEL_WIDTH_IN * len(panels), height), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if isinstance(panel, Bars):
            _bars(ax, panel)
        else:
            _lines(ax, panel)
    figure.suptitle(title, fontsize=12)
    if caption:
        figure.text(0.5, 0.005, caption, ha="center", va="bottom", fontsize=7, color="dimgray")
    figure.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    return path


def _errors(spreads: Sequence[Spread]) -> list[list[float]]:
    return [[s.median - s.min for s in spreads], [s.max - s.median for s in spreads]]


def _bars(ax: plt.Axes, panel: Bars) -> None:
    if panel.horizontal:
        _horizontal_bars(ax, panel)
        return
    labels = [label for label, _ in panel.bars]
    spreads = [value for _, value in panel.bars]
    positions = range(len(labels))
    ax.bar(positions, [s.median for s in spreads], yerr=_errors(spreads), capsize=CAPSIZE, color="tab:blue",
           alpha=0.8)
    for position, value in zip(positions, spreads, strict=True):
        ax.annotate(_number(value.median), (position, value.max), textcoords="offset points", xytext=(0, 3),
                    ha="center", fontsize=8)
    for (name, value), colour in zip(panel.references.items(), REFERENCE_COLOURS, strict=False):
        ax.axhline(value, color=colour, linestyle="--", linewidth=1, label=f"{name}: {_number(value)}")
    if panel.references:
        ax.legend(fontsize=8)
    ax.set_xticks(list(positions), labels, rotation=20, ha="right", fontsize=8)
    _decorate(ax, panel.title, panel.ylabel, panel.log_y)


def _horizontal_bars(ax: plt.Axes, panel: Bars) -> None:
    labels = [label for label, _ in panel.bars]
    spreads = [value for _, value in panel.bars]
    positions = list(range(len(labels)))[::-1]  # the first bar on top
    ax.barh(positions, [s.median for s in spreads], xerr=_errors(spreads), capsize=CAPSIZE, color="tab:blue",
            alpha=0.8)
    for position, value in zip(positions, spreads, strict=True):
        ax.annotate(_number(value.median), (value.max, position), textcoords="offset points", xytext=(4, -3),
                    fontsize=8)
    for (name, value), colour in zip(panel.references.items(), REFERENCE_COLOURS, strict=False):
        ax.axvline(value, color=colour, linestyle="--", linewidth=1, label=f"{name}: {_number(value)}")
    if panel.references:
        ax.legend(fontsize=8, loc="best")
    ax.set_yticks(positions, labels, fontsize=8)
    if panel.log_y:
        ax.set_xscale("log")
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel(panel.ylabel)
    ax.grid(True, axis="x", alpha=0.3)


def _lines(ax: plt.Axes, panel: Lines) -> None:
    for name, points in panel.lines.items():
        ordered = sorted(points, key=lambda point: point[0])
        xs = [x for x, _ in ordered]
        spreads = [value for _, value in ordered]
        ax.errorbar(xs, [s.median for s in spreads], yerr=_errors(spreads), capsize=CAPSIZE, marker="o",
                    markersize=4, label=name)
    if panel.log_x:
        ax.set_xscale("log", base=2)
        ticks = sorted({x for points in panel.lines.values() for x, _ in points})
        ax.set_xticks(ticks, [_number(x) for x in ticks], fontsize=8)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel(panel.xlabel)
    ax.legend(fontsize=8)
    _decorate(ax, panel.title, panel.ylabel, panel.log_y)


def _number(value: float) -> str:
    """``1,234`` for large values, three significant digits for small ones (no exponent notation)."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _decorate(ax: plt.Axes, title: str, ylabel: str, log_y: bool) -> None:
    if log_y:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
