"""Strategies side by side: run each on its own copy of the same simulation, then report
as a table, JSON and a PNG chart.

Every strategy gets its own holdings, cool-downs, `LeaseBook` and jobs over the same
market, the same requests and the same interruption schedule (`engine.simulate`). The
JSON report holds no wall-clock figures, so the same inputs give a byte-identical
report; how fast the backtest ran is `Comparison.speed_line()` (printed on stderr).

`Seeds` holds the comparisons of several seeds (`--seeds N`) and summarises each
strategy's headline figures over them: the mean and a Student-t confidence interval
(`t_interval`).

**A private pool** (`--private-gpus`, `market.PrivateSite`): every strategy runs twice
in one lockstep over the market with the pool (`engine.simulate`): once with the pool
hidden from its view — cloud only, exactly the run of the market without it, so the
report's `strategies` are what they would be without the option — and once seeing it,
hybrid. Same market, same requests, same draws (the pool is never drawn). Every strategy
and not only gpubroker and cheapest_spot: each strategy takes paid-for capacity under
its own rule (`strategies`), which is part of what is compared, and in a table of two
rows per strategy (cloud only, then with the pool) four strategies stay readable; the
second run costs as much as the first (`--strategy` narrows both). The report adds, per
strategy: the owned GPU-hours (servers × GPUs a server × the market's hours), the
GPU-hours leases held on them (busy; a server is one lease's, so the GPUs of a server
held by a smaller job count as busy, and `asked_gpu_hours` says what the jobs asked),
utilisation = busy / owned, the $ saved (cloud-only total − hybrid total) and the $ per
useful GPU-hour saved (cloud-only $/useful GPU-h − hybrid $/useful GPU-h), and both runs'
headline figures, interruptions per 1,000 useful GPU-hours among them. Money is what
leases pay: a lease on the pool pays `--private-price` per GPU-hour of the servers it
holds; the pool's fixed cost is paid either way and counted in neither run (the report
gives it at `--private-price`, for reference, when that is above 0).
"""

from __future__ import annotations

import importlib
import json
import math
import statistics
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

from broker.backtest.engine import Settings, Tally, simulate
from broker.backtest.market import MarketTrace, PrivateSite, hazard_schedule, with_private
from broker.backtest.strategies import build
from broker.backtest.workload import Workload
from broker.model import PoolKey
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


def private_metrics(cloud: Result, hybrid: Result, site: PrivateSite, hours: float
                    ) -> dict[str, Any]:
    """One strategy with the private pool `site` against the same strategy cloud only,
    over a market of `hours` (see the module docstring)."""
    c, h = cloud.metrics(), hybrid.metrics()
    t = hybrid.tally
    owned = site.owned_gpus * hours
    busy = t.reserved_gpu_hours.get(site.key, 0.0)
    cpu_c, cpu_h = c["cost_per_useful_gpu_hour"], h["cost_per_useful_gpu_hour"]
    return {
        "strategy": hybrid.strategy,
        "owned_gpu_hours": _r(owned),
        "busy_gpu_hours": _r(busy),
        "asked_gpu_hours": _r(t.reserved_asked_gpu_hours.get(site.key, 0.0)),
        "utilisation": _r(busy / owned) if owned > 0 else None,
        "paid_on_pool": _r(t.reserved_cost.get(site.key, 0.0)),
        "interruptions_on_pool": sum(1 for _, _, key in t.losses if key == site.key),
        "saved": _r(c["total_cost"] - h["total_cost"]),
        "saved_per_useful_gpu_hour": None if cpu_c is None or cpu_h is None
        else _r(cpu_c - cpu_h),
        "cloud_only": headline(c),
        "hybrid": h,
    }


def private_headline(m: dict[str, Any]) -> dict[str, Any]:
    """The figures of `private_metrics` that `Seeds` summarises: the hybrid run's
    headline figures, the $ saved and the pool's use."""
    return {**headline(m["hybrid"]), "saved": m["saved"],
            "saved_per_useful_gpu_hour": m["saved_per_useful_gpu_hour"],
            "utilisation": m["utilisation"], "busy_gpu_hours": m["busy_gpu_hours"],
            "owned_gpu_hours": m["owned_gpu_hours"]}


PRIVATE_NOTE = ("money counts what leases pay (a lease on the private pool: "
                "--private-price per GPU-hour of the servers it holds); the owned "
                "capacity's fixed cost is not counted: it is paid either way")


@dataclass(frozen=True, slots=True)
class Comparison:
    market: MarketTrace
    workload: Workload
    settings: Settings
    policy: str
    results: tuple[Result, ...]
    wall_seconds: float  # the simulation (not loading or generating the market)
    cpu_seconds: float
    private: PrivateSite | None = None
    """The private pool, when the strategies also ran with it (`hybrid`)."""
    hybrid: tuple[Result, ...] = ()
    """Each strategy of `results` again, seeing the private pool (same order)."""

    @property
    def simulated_hours(self) -> float:
        return self.market.hours * (len(self.results) + len(self.hybrid))

    def owned_gpu_hours(self) -> float:
        return 0.0 if self.private is None else self.private.owned_gpus * self.market.hours

    def fixed_cost(self) -> float | None:
        """The private pool's GPU-hours at `--private-price`, for reference (None at 0 or
        without a pool)."""
        if self.private is None or self.private.price <= 0:
            return None
        return self.owned_gpu_hours() * self.private.price

    def private_metrics(self) -> list[dict[str, Any]]:
        """Per strategy, `private_metrics` (empty without a private pool)."""
        if self.private is None:
            return []
        return [private_metrics(c, h, self.private, self.market.hours)
                for c, h in zip(self.results, self.hybrid, strict=True)]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "market": self.market.describe(),
            "workload": self.workload.describe(),
            "settings": self.settings.to_json(),
            "policy": self.policy,
            "strategies": [r.metrics() for r in self.results],
        }
        if self.private is not None:
            fixed = self.fixed_cost()
            out["private"] = {
                **self.private.to_json(),
                "hours": round(self.market.hours, 6),
                "owned_gpu_hours": _r(self.owned_gpu_hours()),
                "fixed_cost_counted": False,
                "fixed_cost_at_price": None if fixed is None else _r(fixed),
                "note": PRIVATE_NOTE,
                "strategies": self.private_metrics(),
            }
        return out

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n"

    def speed_line(self) -> str:
        rate = self.simulated_hours / self.wall_seconds if self.wall_seconds > 0 else 0.0
        n = len(self.results)
        runs = "" if not self.hybrid else " × 2 (cloud only, with the private pool)"
        return (f"backtest: {n} strateg{'y' if n == 1 else 'ies'}{runs} × "
                f"{self.market.hours:g} simulated hours in {self.wall_seconds:.1f} s wall "
                f"({self.cpu_seconds:.1f} s CPU): {rate:,.1f} simulated hours per second")


REPORT_FORMAT = 2
"""The JSON report's `report_format`: 2 added `report_format`, `market.zone_labels`,
`seeds` and `summary` to the keys of 1 (which had no `report_format`). With a private
pool it adds `private` at the top, in each entry of `seeds` and in `summary`; no key of
a report without one changes."""

CONFIDENCE = 0.95
SUMMARY_METRICS = ("cost_per_useful_gpu_hour", "interruptions_per_1000_gpu_hours",
                   "unplaced")
"""The figures summarised over seeds: $ per useful GPU-hour, interruptions per 1,000
useful GPU-hours, and requests never placed or abandoned."""
PRIVATE_SUMMARY_METRICS = (*SUMMARY_METRICS, "saved", "saved_per_useful_gpu_hour",
                           "utilisation", "busy_gpu_hours")
"""With a private pool, the hybrid runs' figures summarised over seeds: those of
`SUMMARY_METRICS`, the $ saved against cloud only (in all and per useful GPU-hour) and
the pool's use. The intervals of the savings are those of the paired (seed by seed)
differences."""


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
            run: dict[str, Any] = {
                "market_seed": s.market_seed, "workload_seed": s.workload_seed,
                "draw_seed": s.seed, "market": c.market.describe(),
                "workload": c.workload.describe(),
                "strategies": [{"strategy": r.strategy, **headline(r.metrics())}
                               for r in c.results]}
            if c.private is not None:
                run["private"] = [{"strategy": m["strategy"], **private_headline(m)}
                                  for m in c.private_metrics()]
            out.append(run)
        return out

    @staticmethod
    def _interval(xs: Sequence[float]) -> dict[str, Any]:
        if not xs:
            return {"mean": None, "half_width": None, "low": None, "high": None, "n": 0}
        mean, half = t_interval(xs)
        return {"mean": _r(mean), "half_width": None if half is None else _r(half),
                "low": None if half is None else _r(mean - half),
                "high": None if half is None else _r(mean + half), "n": len(xs)}

    def summary(self) -> dict[str, Any]:
        """Per strategy and figure: mean, half-width, low and high of the confidence
        interval (None with one seed), and n, the seeds with the figure (a strategy
        without useful GPU-hours has no cost per useful GPU-hour)."""
        rows = []
        for i, r in enumerate(self.first.results):
            figures = [headline(c.results[i].metrics()) for c in self.runs]
            row: dict[str, Any] = {"strategy": r.strategy}
            for name in SUMMARY_METRICS:
                row[name] = self._interval([f[name] for f in figures if f[name] is not None])
            rows.append(row)
        out = {"seeds": len(self.runs), "confidence": CONFIDENCE,
               "interval": "Student t over seeds", "strategies": rows}
        if self.first.private is not None:
            per_run = [[private_headline(m) for m in c.private_metrics()] for c in self.runs]
            private = []
            for i, r in enumerate(self.first.results):
                row = {"strategy": r.strategy}
                for name in PRIVATE_SUMMARY_METRICS:
                    row[name] = self._interval([f[i][name] for f in per_run
                                                if f[i][name] is not None])
                private.append(row)
            out["private"] = {"strategies": private}
        return out

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
        both = "" if not self.first.hybrid else " × 2 (cloud only, with the private pool)"
        return (f"backtest: {len(self.runs)} seeds × {n} strateg{'y' if n == 1 else 'ies'}"
                f"{both} × {self.first.market.hours:g} simulated hours in {wall:.1f} s wall "
                f"({cpu:.1f} s CPU): {rate:,.1f} simulated hours per second")


def compare(market: MarketTrace, workload: Workload, names: Sequence[str], policy: Policy,
            settings: Settings, *, policy_name: str = "embedded",
            progress: Progress | None = None,
            private: PrivateSite | None = None) -> Comparison:
    """Run each strategy of `names` through `market` and `workload`; with a `private`
    pool, each twice in one lockstep: cloud only, and with the pool (see the module
    docstring)."""
    started, cpu = time.perf_counter(), time.process_time()
    replay = market if private is None else with_private(market, private)
    schedule = hazard_schedule(replay, seed=settings.seed, step_seconds=settings.step_seconds,
                               default_rate=settings.default_interruption_rate)
    strategies = [build(name, policy) for name in names]
    hidden: list[frozenset[PoolKey]] = [frozenset()] * len(strategies)
    if private is not None:
        hidden = [frozenset({private.key})] * len(strategies)
        strategies += [build(name, policy) for name in names]
        hidden += [frozenset()] * len(names)

    def day(n: int, days: int) -> None:
        if progress is not None:
            progress(f"backtest: simulated day {n}/{days}")

    tallies = simulate(replay, workload, strategies, schedule, settings, day, hidden=hidden)
    results = [Result(s.name, s.how, t) for s, t in zip(strategies, tallies, strict=True)]
    return Comparison(market, workload, settings, policy_name, tuple(results[:len(names)]),
                      time.perf_counter() - started, time.process_time() - cpu,
                      private, tuple(results[len(names):]))


def embedded_policy(restart_hours: float | None = None) -> tuple[Any, str]:
    """The policy gpubroker runs under without a file, and its name in the report: the
    daemon's own default policy (`Policy()`: market any, the default scoring), with
    `scoring.restart_hours` set when given."""
    from policies.model import Policy, Scoring

    if restart_hours is None:
        return Policy(), "embedded (the daemon's default policy)"
    return (Policy(scoring=Scoring(restart_hours=restart_hours)),
            f"embedded (the daemon's default policy, restart_hours {restart_hours:g})")


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
    if c.private is not None:
        _private_table(c, [(m["strategy"], m["cloud_only"], private_headline(m))
                           for m in c.private_metrics()], _one, out)


_PRIVATE_COLUMNS = (("$/USEFUL GPU-H", "cost_per_useful_gpu_hour", "{:.4f}"),
                    ("INTR/1K GPU-H", "interruptions_per_1000_gpu_hours", "{:.2f}"),
                    ("UNPLACED", "unplaced", "{}"),
                    ("SAVED $", "saved", "{:,.0f}"),
                    ("SAVED $/USEFUL GPU-H", "saved_per_useful_gpu_hour", "{:.4f}"),
                    ("BUSY GPU-H", "busy_gpu_hours", "{:,.0f}"),
                    ("UTIL", "utilisation", "{:.1%}"))
_FIRST_THREE = 3  # the columns both runs have; the rest are the pool's
_WRAP = 100  # the private section's text lines


def _one(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _private_table(c: Comparison, rows: Sequence[tuple[str, dict[str, Any], dict[str, Any]]],
                   cell: Callable[[Any, str], str], out: TextIO) -> None:
    """Per strategy, a row cloud only and a row with the private pool: (strategy, the
    cloud-only figures, the hybrid figures) → cells by `cell(value, format)`; then the
    footer on money. Means (over seeds) of the unplaced requests get a decimal."""
    columns = [(h, k, "{:.1f}" if cell is _pm_cell and k == "unplaced" else fmt)
               for h, k, fmt in _PRIVATE_COLUMNS]
    site = c.private
    assert site is not None
    print(file=out)
    print(textwrap.fill(
        f"private pool: {site.gpus} × {site.gpu} as {site.servers} server"
        f"{'s' if site.servers != 1 else ''} of {site.per_server} GPUs"
        + (f" in {site.slices} slices" if site.slices > 1 else "") + f" ({site.owned_gpus} "
        f"GPUs) at {site.key.cloud}/{site.key.region}, ${site.price:g}/GPU-h to a lease on "
        f"it; {c.owned_gpu_hours():,.0f} owned GPU-hours over {c.market.hours:g} h. Every "
        f"strategy cloud only, then with the pool: same market, requests and draws.",
        _WRAP), file=out)
    table = [("STRATEGY", "RUN", *(h for h, _, _ in columns))]
    for name, cloud, hybrid in rows:
        table.append((name, "cloud only",
                      *(cell(cloud[k], fmt) for _, k, fmt in columns[:_FIRST_THREE]),
                      *("" for _ in columns[_FIRST_THREE:])))
        table.append(("", "+ private pool", *(cell(hybrid[k], fmt) for _, k, fmt in columns)))
    print(file=out)
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(text.ljust(wd) if i < 2 else text.rjust(wd)
                        for i, (text, wd) in enumerate(zip(row, widths, strict=True))
                        ).rstrip(), file=out)
    fixed = c.fixed_cost()
    print(file=out)
    print(textwrap.fill(
        "SAVED: cloud only − with the pool, in all and per useful GPU-hour (the difference "
        "of $/useful GPU-h); BUSY: GPU-hours leases held on the pool (whole servers); UTIL: "
        f"busy / owned. {PRIVATE_NOTE[0].upper()}{PRIVATE_NOTE[1:]}."
        + ("" if fixed is None else f" For reference, the pool's "
           f"{c.owned_gpu_hours():,.0f} GPU-hours at ${site.price:g}/GPU-h: ${fixed:,.0f} "
           "over the run."), _WRAP), file=out)


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
    if c.private is not None:
        summary_all = seeds.summary()
        cloud = {d["strategy"]: d for d in summary_all["strategies"]}
        _private_table(c, [(d["strategy"], cloud[d["strategy"]], d)
                           for d in summary_all["private"]["strategies"]], _pm_cell, out)


def _pm_cell(value: Any, fmt: str) -> str:
    return _pm(value, fmt)


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
