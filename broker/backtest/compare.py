"""Strategies side by side: run each on its own copy of the same simulation, then report
as a table, JSON and a PNG chart.

Every strategy gets its own holdings, cool-downs, `LeaseBook` and jobs over the same
market, the same requests and the same interruption schedule (`engine.simulate`). The
JSON report holds no wall-clock figures, so the same inputs give a byte-identical
report; how fast the backtest ran is `Comparison.speed_line()` (printed on stderr).

`Seeds` holds the comparisons of several seeds (`--seeds N`) and summarises each
strategy's headline figures over them: the mean and a Student-t confidence interval
(`t_interval`).
"""

from __future__ import annotations

import importlib
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

from broker.backtest.engine import Settings, Tally, simulate
from broker.backtest.market import MarketTrace, hazard_schedule
from broker.backtest.strategies import build
from broker.backtest.workload import Workload
from policies.model import Policy

Progress = Callable[[str], None]


class ChartUnavailable(RuntimeError):
    """matplotlib is not installed; the message says which extra to install."""


@dataclass(frozen=True, slots=True)
class Result:
    strategy: str
    how: str
    tally: Tally

    def metrics(self) -> dict[str, Any]:
        t = self.tally
        useful = t.useful_gpu_hours
        interruptions = t.interrupted + t.capacity_lost
        return {
            "strategy": self.strategy,
            "how": self.how,
            "cost_per_useful_gpu_hour": _r(t.cost / useful) if useful else None,
            "total_cost": _r(t.cost),
            "useful_gpu_hours": _r(useful),
            "paid_gpu_hours": _r(t.paid_gpu_hours),
            "lost_gpu_hours": _r(t.lost_gpu_hours),
            "idle_gpu_hours": _r(t.idle_gpu_hours),
            "spot_share": _r(t.spot_gpu_hours / t.paid_gpu_hours) if t.paid_gpu_hours
            else None,
            "interruptions": interruptions,
            "interrupted": t.interrupted,
            "capacity_lost": t.capacity_lost,
            "interruptions_per_1000_gpu_hours": _r(1000 * interruptions / useful)
            if useful else None,
            "failovers": sum(t.failovers.values()),
            "failovers_by_reason": dict(sorted(t.failovers.items())),
            "failovers_with_nowhere_to_go": t.failovers_nowhere,
            "requests": t.requests,
            "placed": t.placed,
            "completed": t.completed,
            "running_at_end": t.running_at_end,
            "waiting_at_end": t.waiting_at_end,
            "abandoned": t.abandoned,
            "never_placed": sum(t.never_placed.values()),
            "never_placed_by_code": dict(sorted(t.never_placed.items())),
            "mean_wait_hours": _r(statistics.fmean(t.waits)) if t.waits else None,
            "p95_wait_hours": _r(_quantile(t.waits, 0.95)) if t.waits else None,
            "hours_without_placement_after_loss": _r(t.hours_without_placement),
        }


def _r(x: float) -> float:
    return round(x, 6)


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


@dataclass(frozen=True, slots=True)
class Comparison:
    market: MarketTrace
    workload: Workload
    settings: Settings
    policy: str
    results: tuple[Result, ...]
    wall_seconds: float  # the simulation (not loading or generating the market)
    cpu_seconds: float

    @property
    def simulated_hours(self) -> float:
        return self.market.hours * len(self.results)

    def to_json(self) -> dict[str, Any]:
        return {
            "market": self.market.describe(),
            "workload": self.workload.describe(),
            "settings": self.settings.to_json(),
            "policy": self.policy,
            "strategies": [r.metrics() for r in self.results],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n"

    def speed_line(self) -> str:
        rate = self.simulated_hours / self.wall_seconds if self.wall_seconds > 0 else 0.0
        n = len(self.results)
        return (f"backtest: {n} strateg{'y' if n == 1 else 'ies'} × {self.market.hours:g} "
                f"simulated hours in {self.wall_seconds:.1f} s wall "
                f"({self.cpu_seconds:.1f} s CPU): {rate:,.1f} simulated hours per second")


REPORT_FORMAT = 2
"""The JSON report's `report_format`: 2 added `report_format`, `market.zone_labels`,
`seeds` and `summary` to the keys of 1 (which had no `report_format`)."""

CONFIDENCE = 0.95
SUMMARY_METRICS = ("cost_per_useful_gpu_hour", "interruptions_per_1000_gpu_hours",
                   "unplaced")
"""The figures summarised over seeds: $ per useful GPU-hour, interruptions per 1,000
useful GPU-hours, and requests never placed or abandoned."""


def t_interval(xs: Sequence[float], confidence: float = CONFIDENCE
               ) -> tuple[float, float | None]:
    """The mean of `xs` and the half-width of its two-sided Student-t confidence
    interval, `t(1 − (1 − confidence)/2, n − 1) × s / √n` with s the sample standard
    deviation; the half-width is None for fewer than two values."""
    if not xs:
        raise ValueError("t_interval: no values")
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return mean, None
    from scipy.stats import t

    q = float(t.ppf(1 - (1 - confidence) / 2, len(xs) - 1))
    return mean, q * statistics.stdev(xs) / math.sqrt(len(xs))


def headline(metrics: dict[str, Any]) -> dict[str, Any]:
    """The figures of one strategy's metrics that `Seeds` summarises, and what they come
    from."""
    return {"cost_per_useful_gpu_hour": metrics["cost_per_useful_gpu_hour"],
            "interruptions_per_1000_gpu_hours": metrics["interruptions_per_1000_gpu_hours"],
            "unplaced": metrics["never_placed"] + metrics["abandoned"],
            "never_placed": metrics["never_placed"], "abandoned": metrics["abandoned"],
            "useful_gpu_hours": metrics["useful_gpu_hours"],
            "total_cost": metrics["total_cost"]}


@dataclass(frozen=True, slots=True)
class Seeds:
    """The comparisons of the same strategies over several seeds, in seed order."""

    runs: tuple[Comparison, ...]

    @property
    def first(self) -> Comparison:
        return self.runs[0]

    def per_seed(self) -> list[dict[str, Any]]:
        out = []
        for c in self.runs:
            s = c.settings
            out.append({"market_seed": s.market_seed, "workload_seed": s.workload_seed,
                        "draw_seed": s.seed, "market": c.market.describe(),
                        "workload": c.workload.describe(),
                        "strategies": [{"strategy": r.strategy, **headline(r.metrics())}
                                       for r in c.results]})
        return out

    def summary(self) -> dict[str, Any]:
        """Per strategy and figure: mean, half-width, low and high of the confidence
        interval (None with one seed), and n, the seeds with the figure (a strategy
        without useful GPU-hours has no cost per useful GPU-hour)."""
        rows = []
        for i, r in enumerate(self.first.results):
            figures = [headline(c.results[i].metrics()) for c in self.runs]
            row: dict[str, Any] = {"strategy": r.strategy}
            for name in SUMMARY_METRICS:
                xs = [f[name] for f in figures if f[name] is not None]
                if not xs:
                    row[name] = {"mean": None, "half_width": None, "low": None,
                                 "high": None, "n": 0}
                    continue
                mean, half = t_interval(xs)
                row[name] = {"mean": _r(mean), "half_width": None if half is None
                             else _r(half), "low": None if half is None else _r(mean - half),
                             "high": None if half is None else _r(mean + half),
                             "n": len(xs)}
            rows.append(row)
        return {"seeds": len(self.runs), "confidence": CONFIDENCE,
                "interval": "Student t over seeds", "strategies": rows}

    def to_json(self) -> dict[str, Any]:
        """The first seed's report (the keys of a single-seed report), its format, every
        seed's headline figures and their summary."""
        return {"report_format": REPORT_FORMAT, **self.first.to_json(),
                "seeds": self.per_seed(), "summary": self.summary()}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n"

    def speed_line(self) -> str:
        if len(self.runs) == 1:
            return self.first.speed_line()
        wall = sum(c.wall_seconds for c in self.runs)
        cpu = sum(c.cpu_seconds for c in self.runs)
        hours = sum(c.simulated_hours for c in self.runs)
        n = len(self.first.results)
        rate = hours / wall if wall > 0 else 0.0
        return (f"backtest: {len(self.runs)} seeds × {n} strateg{'y' if n == 1 else 'ies'} "
                f"× {self.first.market.hours:g} simulated hours in {wall:.1f} s wall "
                f"({cpu:.1f} s CPU): {rate:,.1f} simulated hours per second")


def compare(market: MarketTrace, workload: Workload, names: Sequence[str], policy: Policy,
            settings: Settings, *, policy_name: str = "embedded",
            progress: Progress | None = None) -> Comparison:
    """Run each strategy of `names` through `market` and `workload`."""
    started, cpu = time.perf_counter(), time.process_time()
    schedule = hazard_schedule(market, seed=settings.seed, step_seconds=settings.step_seconds,
                               default_rate=settings.default_interruption_rate)
    strategies = [build(name, policy) for name in names]

    def day(n: int, days: int) -> None:
        if progress is not None:
            progress(f"backtest: simulated day {n}/{days}")

    tallies = simulate(market, workload, strategies, schedule, settings, day)
    results = [Result(s.name, s.how, t) for s, t in zip(strategies, tallies, strict=True)]
    return Comparison(market, workload, settings, policy_name, tuple(results),
                      time.perf_counter() - started, time.process_time() - cpu)


# --- output -----------------------------------------------------------------------------

_COLUMNS = (
    ("STRATEGY", "strategy", "{}"),
    ("$/USEFUL GPU-H", "cost_per_useful_gpu_hour", "{:.4f}"),
    ("TOTAL $", "total_cost", "{:,.0f}"),
    ("USEFUL GPU-H", "useful_gpu_hours", "{:,.0f}"),
    ("LOST GPU-H", "lost_gpu_hours", "{:,.0f}"),
    ("SPOT", "spot_share", "{:.0%}"),
    ("INTR", "interruptions", "{}"),
    ("INTR/1K GPU-H", "interruptions_per_1000_gpu_hours", "{:.2f}"),
    ("FAILOVERS", "failovers", "{}"),
    ("NEVER PLACED", "never_placed", "{}"),
    ("MEAN WAIT H", "mean_wait_hours", "{:.2f}"),
)


def write_table(c: Comparison, out: TextIO) -> None:
    m, w = c.market.describe(), c.workload.describe()
    print(f"market {m['source']}: {m['start']} to {m['end']} ({m['hours']:g} h, "
          f"{m['pools']} pools, {m['rows']} rows)", file=out)
    print(f"workload {w['source']}: {w['requests']} requests, {w['gpu_hours_asked']:,.0f} "
          f"GPU-hours asked" + (f" ({w['left_out_after_market_end']} after the market's end "
                                "left out)" if w["left_out_after_market_end"] else ""),
          file=out)
    s = c.settings
    print(f"policy {c.policy}; {_seeds(s)}, step {s.step_seconds / 60:g} min, restart "
          f"{s.restart_hours:g} h, max wait {s.max_wait_hours:g} h", file=out)
    rows = [tuple(h for h, _, _ in _COLUMNS)]
    for r in c.results:
        d = r.metrics()
        rows.append(tuple("-" if d[k] is None else fmt.format(d[k]) for _, k, fmt in _COLUMNS))
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    print(file=out)
    for row in rows:
        print("  ".join(cell.ljust(wd) if i == 0 else cell.rjust(wd)
                        for i, (cell, wd) in enumerate(zip(row, widths, strict=True))),
              file=out)


def _seeds(s: Settings) -> str:
    """Which seeds a run used: the draws' always; the market's and the workload's when
    generated (or, for a trace file, the zone labels' permutation)."""
    named = [f"draw seed {s.seed}"]
    if s.market_seed is not None:
        named.append(f"market seed {s.market_seed}")
    if s.workload_seed is not None:
        named.append(f"workload seed {s.workload_seed}")
    return ", ".join(named)


def _span(values: Sequence[int | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    if len(set(known)) == 1:
        return str(known[0])
    if known == list(range(known[0], known[0] + len(known))):
        return f"{known[0]}..{known[-1]}"
    return ",".join(str(v) for v in known)


def _pm(d: dict[str, Any], fmt: str) -> str:
    if d["mean"] is None:
        return "-"
    text = fmt.format(d["mean"])
    return text if d["half_width"] is None else f"{text} ± {fmt.format(d['half_width'])}"


_SUMMARY_COLUMNS = (("$/USEFUL GPU-H", "cost_per_useful_gpu_hour", "{:.4f}"),
                    ("INTR/1K GPU-H", "interruptions_per_1000_gpu_hours", "{:.2f}"),
                    ("UNPLACED", "unplaced", "{:.1f}"))


def write_seeds_table(seeds: Seeds, out: TextIO) -> None:
    """Per strategy, the mean ± the confidence interval's half-width over the seeds of
    $ per useful GPU-hour, interruptions per 1,000 useful GPU-hours and requests never
    placed or abandoned; then each seed's figures. One seed: `write_table`."""
    if len(seeds.runs) == 1:
        write_table(seeds.first, out)
        return
    c = seeds.first
    m, w, s = c.market.describe(), c.workload.describe(), c.settings
    runs = [r.settings for r in seeds.runs]
    print(f"market {m['source']}: {m['start']} to {m['end']} ({m['hours']:g} h, "
          f"{m['pools']} pools, {m['rows']} rows, zone labels {m['zone_labels']})",
          file=out)
    sources = {r.workload.source for r in seeds.runs}
    source = w["source"] if len(sources) == 1 else f"gen:{w['requests']} (seeded as below)"
    print(f"workload {source}: {w['requests']} requests", file=out)
    print(f"policy {c.policy}; step {s.step_seconds / 60:g} min, restart "
          f"{s.restart_hours:g} h, max wait {s.max_wait_hours:g} h", file=out)
    print(f"{len(runs)} seeds: market {_span([r.market_seed for r in runs])}, workload "
          f"{_span([r.workload_seed for r in runs])}, draws {_span([r.seed for r in runs])}; "
          f"mean ± half-width of the {CONFIDENCE:.0%} Student-t interval", file=out)
    summary = seeds.summary()["strategies"]
    rows = [("STRATEGY", *(h for h, _, _ in _SUMMARY_COLUMNS))]
    rows += [(d["strategy"], *(_pm(d[k], fmt) for _, k, fmt in _SUMMARY_COLUMNS))
             for d in summary]
    print(file=out)
    _print_rows(rows, out)
    print(file=out)
    print("per seed (market/workload/draws): $/useful GPU-h, interruptions/1k GPU-h, "
          "unplaced", file=out)
    rows = [("SEEDS", *(r.strategy for r in c.results))]
    for run in seeds.per_seed():
        label = "/".join("-" if run[k] is None else str(run[k])
                         for k in ("market_seed", "workload_seed", "draw_seed"))
        rows.append((label, *(" / ".join(
            "-" if f[k] is None else fmt.format(f[k])
            for _, k, fmt in (*_SUMMARY_COLUMNS[:2], ("", "unplaced", "{}")))
            for f in run["strategies"])))
    _print_rows(rows, out)


def _print_rows(rows: Sequence[Sequence[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(wd) if i == 0 else cell.rjust(wd)
                        for i, (cell, wd) in enumerate(zip(row, widths, strict=True))),
              file=out)


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
    """One point per strategy with useful GPU-hours, and the legend lines of those
    without (nothing to plot)."""
    points, unplotted = [], []
    for i, r in enumerate(c.results):
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
    for i, row in enumerate(seeds.summary()["strategies"]):
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
    95 % confidence intervals of both."""
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
                 + (f"; means over {runs} seeds, bars: 95 % intervals" if runs > 1 else ""),
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
