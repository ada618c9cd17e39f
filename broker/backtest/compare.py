"""Strategies side by side: run each on its own copy of the same simulation, then report
as a table, JSON and a PNG chart.

Every strategy gets its own holdings, cool-downs, `LeaseBook` and jobs over the same
market, the same requests and the same interruption schedule (`engine.simulate`). The
JSON report holds no wall-clock figures, so the same inputs give a byte-identical
report; how fast the backtest ran is `Comparison.speed_line()` (printed on stderr).
"""

from __future__ import annotations

import importlib
import json
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
    print(f"policy {c.policy}; seed {s.seed}, step {s.step_seconds / 60:g} min, restart "
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


def write_chart(c: Comparison, path: Path) -> None:
    """Cost per useful GPU-hour against interruptions per 1,000 GPU-hours, one labelled
    point per strategy, as a PNG (matplotlib's Agg renderer, no display needed)."""
    figure = _matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figure.Figure(figsize=(7.5, 5.0), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    points = [(r.strategy, d["interruptions_per_1000_gpu_hours"],
               d["cost_per_useful_gpu_hour"])
              for r in c.results if (d := r.metrics())["cost_per_useful_gpu_hour"] is not None]
    for (name, x, y), (dx, dy, ha) in zip(points, _label_offsets(points), strict=True):
        ax.scatter([x], [y], s=60, zorder=3)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(dx, dy), ha=ha,
                    fontsize=10)
    ax.set_xlabel("interruptions per 1,000 useful GPU-hours")
    ax.set_ylabel("cost per useful GPU-hour (USD)")
    m, w = c.market.describe(), c.workload.describe()
    ax.set_title(f"backtest: {m['source']} ({m['hours']:g} h), {w['source']}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.margins(0.2)
    fig.tight_layout()
    fig.savefig(str(path), format="png")


_OFFSETS = ((7, 6, "left"), (-7, 6, "right"), (7, -15, "left"), (-7, -15, "right"))


def _label_offsets(points: Sequence[tuple[str, float, float]]
                   ) -> list[tuple[int, int, str]]:
    """Where each point's label goes: the first of four offsets whose label would not sit
    on one already placed near it (points close together get labels on different sides)."""
    xs, ys = [p[1] for p in points], [p[2] for p in points]
    wx = (max(xs) - min(xs)) or 1.0 if xs else 1.0
    wy = (max(ys) - min(ys)) or 1.0 if ys else 1.0
    placed: list[tuple[float, float, tuple[int, int, str]]] = []
    out = []
    for _, x, y in points:
        nx, ny = x / wx, y / wy
        for offset in _OFFSETS:
            if not any(o == offset and abs(nx - px) < 0.3 and abs(ny - py) < 0.08
                       for px, py, o in placed):
                break
        placed.append((nx, ny, offset))
        out.append(offset)
    return out
