"""Strategies side by side: run each on its own copy of the same simulation, then report
as a table, JSON and a PNG chart.

Every strategy gets its own holdings, cool-downs, `LeaseBook` and jobs over the same
market, the same requests and the same interruption schedule (`engine.simulate`). The
JSON report holds no wall-clock figures, so the same inputs give a byte-identical
report; how fast the backtest ran is `Comparison.speed_line()` (printed on stderr).

`Seeds` holds the comparisons of several seeds (`--seeds N`) and summarises each
strategy's headline figures over them: the mean and a Student-t confidence interval
(`t_interval`).

**A private pool** (`--private-gpus`, `private.PrivateSite`): every strategy runs twice
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

import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from broker.backtest.draws import HazardSchedule, hazard_schedule
from broker.backtest.engine import simulate
from broker.backtest.ledger import Settings, Tally
from broker.backtest.market import MarketTrace
from broker.backtest.private import PrivateSite, with_private
from broker.backtest.strategies import Strategy, build
from broker.backtest.workload import Workload
from broker.model import PoolKey
from policies.model import Policy

Progress = Callable[[str], None]


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
            "spot_share_by_cloud": {
                cloud: _r(hours / t.spot_gpu_hours)
                for cloud, hours in sorted(t.spot_gpu_hours_by_cloud.items())}
            if t.spot_gpu_hours else {},
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
    truth: str = ""
    """What the interruption draws follow (`HazardSchedule.truth`)."""

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
            "interruptions_drawn_from": self.truth,
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


REPORT_FORMAT = 3
"""The JSON report's `report_format`: 3 added `interruptions_drawn_from`,
`settings.pool_wide_share` and each strategy's `spot_share_by_cloud`; 2 added
`report_format`, `market.zone_labels`, `seeds` and `summary` to the keys of 1 (which
had no `report_format`). With a private
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


Extra = Callable[[HazardSchedule, MarketTrace], Sequence[Strategy]]
"""Makes strategies to run beside the named ones, from the draws and the market."""


# Many arguments: what is compared, then keyword-only options (each of its own).
def compare(market: MarketTrace, workload: Workload, names: Sequence[str], policy: Policy,  # noqa: PLR0913
            settings: Settings, *, policy_name: str = "embedded",
            progress: Progress | None = None,
            private: PrivateSite | None = None,
            extra: Extra | None = None) -> Comparison:
    """Run each strategy of `names` through `market` and `workload`; with a `private`
    pool, each twice in one lockstep: cloud only, and with the pool (see the module
    docstring). The strategies `extra` makes from the interruption draws and the market
    (gpubroker under other settings; an `Oracle` that sees the draws' true hazards) run
    in the same lockstep after them, without a private pool."""
    if private is not None and extra is not None:
        raise ValueError("compare: extra strategies run without a private pool")
    started, cpu = time.perf_counter(), time.process_time()
    replay = market if private is None else with_private(market, private)
    schedule = hazard_schedule(replay, seed=settings.seed, step_seconds=settings.step_seconds,
                               default_rate=settings.default_interruption_rate,
                               pool_wide_share=settings.pool_wide_share)
    strategies = [build(name, policy) for name in names]
    if extra is not None:
        strategies += extra(schedule, replay)
    ran = len(strategies)
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
    return Comparison(market, workload, settings, policy_name, tuple(results[:ran]),
                      time.perf_counter() - started, time.process_time() - cpu,
                      private, tuple(results[ran:]), schedule.truth)


def embedded_policy(restart_hours: float | None = None) -> tuple[Any, str]:
    """The policy gpubroker runs under without a file, and its name in the report: the
    daemon's own default policy (`Policy()`: market any, the default scoring), with
    `scoring.restart_hours` set when given."""
    from policies.model import Policy, Scoring

    if restart_hours is None:
        return Policy(), "embedded (the daemon's default policy)"
    return (Policy(scoring=Scoring(restart_hours=restart_hours)),
            f"embedded (the daemon's default policy, restart_hours {restart_hours:g})")
