"""A comparison as a PNG chart: cost per useful GPU-hour against interruptions, a point
per strategy (with several seeds: the means and their confidence intervals)."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from broker.backtest.compare import Comparison, Result, Seeds


class ChartUnavailable(RuntimeError):
    """matplotlib is not installed; the message says which extra to install."""


def _matplotlib() -> ModuleType:
    try:
        importlib.import_module("matplotlib")
        return importlib.import_module("matplotlib.figure")
    except ModuleNotFoundError:
        raise ChartUnavailable("the backtest chart needs matplotlib: pip install "
                               "'gpubroker[report]'") from None


def check_chart() -> None:
    """Raise ChartUnavailable now rather than after a long run."""
    _matplotlib()

HYBRID_SUFFIX = " + private"
"""A strategy's name in the chart when it ran with the private pool."""

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "<", ">", "p")


@dataclass(frozen=True, slots=True)
class _Point:
    name: str
    x: float  # interruptions per 1,000 useful GPU-hours
    y: float  # cost per useful GPU-hour
    legend: str
    style: int  # marker and colour
    xerr: float | None = None  # half-widths of the confidence interval (over seeds)
    yerr: float | None = None


def _points(c: Comparison) -> tuple[list[_Point], list[str]]:
    """One point per strategy with useful GPU-hours (and per strategy with the private
    pool, named `… + private`), and the legend lines of those without (nothing to
    plot)."""
    points, unplotted = [], []
    runs = [*c.results, *(Result(f"{r.strategy}{HYBRID_SUFFIX}", r.how, r.tally)
                          for r in c.hybrid)]
    for i, r in enumerate(runs):
        d = r.metrics()
        unplaced = f"{d['never_placed']} of {d['requests']} requests never placed"
        if d["abandoned"]:
            unplaced += f", {d['abandoned']} abandoned"
        if d["cost_per_useful_gpu_hour"] is None:
            unplotted.append(f"{r.strategy}: no useful GPU-hours; {unplaced}")
            continue
        x, y = d["interruptions_per_1000_gpu_hours"], d["cost_per_useful_gpu_hour"]
        points.append(_Point(r.strategy, x, y,
                             f"{r.strategy}: ${y:.4f} per useful GPU-h, {x:.2f} "
                             f"interruptions per 1,000; {unplaced}", i))
    return points, unplotted


def _seed_points(seeds: Seeds) -> tuple[list[_Point], list[str]]:
    """`_points` over several seeds: each strategy at its means, with the half-widths of
    their confidence intervals, and its mean unplaced requests."""
    points, unplotted = [], []
    summary = seeds.summary()
    rows = [*summary["strategies"],
            *({**row, "strategy": f"{row['strategy']}{HYBRID_SUFFIX}"}
              for row in summary.get("private", {}).get("strategies", ()))]
    for i, row in enumerate(rows):
        cost = row["cost_per_useful_gpu_hour"]
        intr = row["interruptions_per_1000_gpu_hours"]
        unplaced = f"{row['unplaced']['mean']:.1f} requests unplaced on average"
        name = row["strategy"]
        if cost["mean"] is None or intr["mean"] is None:
            unplotted.append(f"{name}: no useful GPU-hours; {unplaced}")
            continue
        x, y = intr["mean"], cost["mean"]
        xe, ye = intr["half_width"], cost["half_width"]
        points.append(_Point(name, x, y, f"{name}: ${y:.4f} ± {ye or 0:.4f} per useful "
                             f"GPU-h, {x:.2f} ± {xe or 0:.2f} interruptions per 1,000; "
                             f"{unplaced}", i, xe, ye))
    return points, unplotted


def write_chart(c: Comparison | Seeds, path: Path) -> None:
    """Cost per useful GPU-hour against interruptions per 1,000 GPU-hours, one point per
    strategy, as a PNG (matplotlib's Agg renderer, no display needed). Both axes start at
    0 (lower-left is better); each strategy has its own marker and colour, and its
    legend line gives its figures and its unplaced requests; points that (nearly)
    coincide are drawn inside one another and share one label, a name a line. Over
    several seeds (`Seeds`), each point is at the strategy's means, with bars for the
    95 % confidence intervals of both. With a private pool, each strategy has a second
    point, with the pool."""
    figure = _matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    runs = len(c.runs) if isinstance(c, Seeds) else 1
    if isinstance(c, Seeds):
        points, unplotted = _points(c.first) if runs == 1 else _seed_points(c)
        c = c.first
    else:
        points, unplotted = _points(c)
    lines = len(points) + len(unplotted)
    legend_in = 0.2 * lines + 0.3
    fig = figure.Figure(figsize=(9.0, 5.6 + legend_in), dpi=110)
    FigureCanvasAgg(fig)
    height = 5.6 + legend_in
    fig.subplots_adjust(left=0.09, right=0.97, top=1 - 0.85 / height,
                        bottom=(legend_in + 0.65) / height)
    ax = fig.add_subplot()
    colours = [f"C{i}" for i in range(10)]
    groups = _coinciding(points)
    for group in groups:
        # the largest marker first: a point drawn on another stays visible inside it
        for k, p in enumerate(group):
            size = 170 - 130 * k / (len(group) - 1) if len(group) > 1 else 90
            ax.scatter([p.x], [p.y], s=size, marker=_MARKERS[p.style % len(_MARKERS)],
                       color=colours[p.style % len(colours)], edgecolors="black",
                       linewidths=0.6, zorder=3 + k, clip_on=False)
    for p in points:
        if p.xerr or p.yerr:
            ax.errorbar([p.x], [p.y], xerr=[p.xerr or 0.0], yerr=[p.yerr or 0.0], fmt="none",
                        ecolor=colours[p.style % len(colours)], elinewidth=1.0, capsize=4,
                        zorder=2, clip_on=False)
    xmax = max((p.x + (p.xerr or 0.0) for p in points), default=0.0)
    ymax = max((p.y + (p.yerr or 0.0) for p in points), default=0.0)
    ax.set_xlim(0, xmax * 1.18 if xmax > 0 else 1.0)
    ax.set_ylim(0, ymax * 1.18 if ymax > 0 else 1.0)
    ax.set_xlabel("interruptions per 1,000 useful GPU-hours")
    ax.set_ylabel("cost per useful GPU-hour (USD)")
    ax.grid(True, alpha=0.3)
    ax.annotate("lower-left is better", xy=(0.0, 0.0), xycoords="axes fraction",
                xytext=(0.05, 0.09), textcoords="axes fraction", fontsize=10,
                color="0.35", style="italic",
                arrowprops={"arrowstyle": "->", "color": "0.5", "lw": 0.8})
    m, w, s = c.market.describe(), c.workload.describe(), c.settings
    fig.suptitle("Backtest: cost against interruptions, per strategy", fontsize=13,
                 fontweight="bold", y=1 - 0.18 / height)
    ax.set_title(f"market {m['source']} ({m['hours']:g} h, {m['pools']} pools), workload "
                 f"{w['source']} ({w['requests']} requests), restart {s.restart_hours:g} h"
                 + (f"; means over {runs} seeds, bars: 95 % intervals" if runs > 1 else "")
                 + ("" if c.private is None else f"\n'{HYBRID_SUFFIX.strip()}': with "
                    f"{c.private.gpus} private {c.private.gpu} at ${c.private.price:g}/GPU-h"),
                 fontsize=9, color="0.3")
    _label(fig, ax, groups)
    from matplotlib.lines import Line2D

    labels = [p.legend for p in points] + unplotted
    artists = [Line2D([], [], linestyle="none", marker=_MARKERS[p.style % len(_MARKERS)],
                      markersize=8, color=colours[p.style % len(colours)],
                      markeredgecolor="black", markeredgewidth=0.6) for p in points]
    artists += [Line2D([], [], linestyle="none") for _ in unplotted]
    fig.legend(artists, labels, loc="lower left", bbox_to_anchor=(0.07, 0.1 / height),
               fontsize=8.5, frameon=False, handletextpad=0.4, borderaxespad=0.0)
    fig.savefig(str(path), format="png")


def _coinciding(points: Sequence[_Point]) -> list[list[_Point]]:
    """Points in groups of those that would be drawn on one another (within 1 % of the
    axes' spans), in the order of their first point."""
    sx = max((p.x for p in points), default=0.0) or 1.0
    sy = max((p.y for p in points), default=0.0) or 1.0
    groups: list[list[_Point]] = []
    for p in points:
        for g in groups:
            if abs(g[0].x - p.x) / sx < 0.01 and abs(g[0].y - p.y) / sy < 0.01:
                g.append(p)
                break
        else:
            groups.append([p])
    return groups


# Where a label may go, in points from its point: close first, then farther out (with a
# leader line).
_OFFSETS = tuple((dx * r, dy * r) for r in (1, 2, 3.2)
                 for dx, dy in ((9, 7), (9, -14), (-9, 7), (-9, -14), (12, -3), (-12, -3),
                                (0, 12), (0, -18)))


def _label(fig: Any, ax: Any, groups: Sequence[Sequence[_Point]]) -> None:
    """Name each group of points next to it, where the label covers no other label, no
    point and stays inside the axes: the first place that fits, close first, else the
    place that overlaps least."""
    renderer = fig.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    marks = [ax.transData.transform((p.x, p.y)) for g in groups for p in g]
    taken: list[Any] = []
    scale = fig.dpi / 72

    def outside(box: Any) -> float:
        return float(max(0.0, inside.x0 - box.x0) + max(0.0, box.x1 - inside.x1)
                     + max(0.0, inside.y0 - box.y0) + max(0.0, box.y1 - inside.y1))

    for group in groups:
        x, y = group[0].x, group[0].y
        text = "\n".join(p.name for p in group)
        best, least = None, float("inf")
        for dx, dy in _OFFSETS:
            far = abs(dx) > 13 or abs(dy) > 19
            a = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy),
                            ha="left" if dx >= 0 else "right", va="bottom" if dy >= 0
                            else "top" if dy < -5 else "center", fontsize=9, zorder=10,
                            arrowprops={"arrowstyle": "-", "color": "0.5", "lw": 0.6,
                                        "shrinkA": 0, "shrinkB": 5} if far else None)
            box = a.get_window_extent(renderer).expanded(1.05, 1.15)
            bad = (1000 * outside(box) + 100 * sum(box.overlaps(t) for t in taken)
                   + sum(box.x0 - 5 * scale <= mx <= box.x1 + 5 * scale
                         and box.y0 - 5 * scale <= my <= box.y1 + 5 * scale
                         for mx, my in marks))
            if bad < least:
                if best is not None:
                    best.remove()
                best, least = a, bad
            else:
                a.remove()
            if bad == 0:
                break
        assert best is not None
        taken.append(best.get_window_extent(renderer))
