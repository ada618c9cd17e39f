"""The market a backtest replays: a trace grouped into steps, and the interruption draws.

A market comes from a trace file (`broker.market.traces.read_trace`: rows ordered by time, each
a pool's full state from its `t` until that pool's next row, or `gone`) or is generated
from the simulated market (`adapters.sim.SimAdapter`, list prices from the real price
snapshot) on a simulated clock: one poll of every region per step, only changes kept.

`Market.steps` groups the rows by instant; each step lists, per slice (cloud, region),
the pools that changed (`None` for gone). A replay applies them to a real
`ResourcePool`, a slice at a time, as the poller does.

**Hidden truth.** A generated market carries, beside the rows, each spot pool's hidden
true hazard at every step (`MarketTrace.truth`, from `SimAdapter.true_rates`): the
simulated market's offers show only a lagged, noisy, quantised and sometimes missing
signal of it (adapters/sim.py), and strategies see only those offers. The interruption
draws use the truth. A market read from a trace file has none: its draws use each row's
`interruption_rate` (`default_rate` when the row has none) times a hidden per-pool
factor (`draws.hidden_factor`: lognormal, median 1, drawn from the draw seed), so a
trace that carries rates, recorded by `gpubroker history` or saved by `--save-market`,
is never replayed with the signal as the truth. `--save-market` writes the observed
rows only (the trace format has no hidden column), so a saved simulated market replayed
from its file draws from the observed rates times that factor, not from the truth.

**Interruption draws** (`hazard_schedule`) are a property of the market and the draw
seed, made once and shared by every strategy. For step k of the fixed grid (`step`
seconds from the start) a spot pool offered at its start has the rate λ of `t_k` (the
truth, else the row's rate times the pool's hidden factor). A share (`POOL_WIDE_SHARE`,
or the settings' `pool_wide_share`) of it is pool-wide, a capacity
reclaim that hits every lease on the pool at once: `u, v = H(seed, pool, k)` (a stable
hash, BLAKE2b, not Python's salted `hash`), a hit at `t_k + v × step` when
`u < 1 − exp(−share × λ × step)`. The rest is per instance: a lease of n instances held
by job j meets its own draw `u, v = H(seed, pool, k, j)` and is interrupted at
`t_k + v × step` when `u < 1 − exp(−(1 − share) × λ × n × step)`, the chance that any of
its n instances is reclaimed. One instance thus sees the hazard λ; a gang of 16 about
`share × λ + (1 − share) × 16 λ`. The draws depend on (seed, pool, step, job) only, so
every strategy that puts the same job on the same pool in the same step meets the same
draw (common random numbers), whoever runs first or alongside.

**Zone labels** (`relabel_zones`). Strategies that tie on price and risk choose by pool
key, that is by region and zone name; in a recorded trace the alphabetically first
zone may well be the worst (in `data/traces`' 9-zone AWS trace, us-east-1a is available
17 % of the time, and all spot prices are equal). So a market read from a file has its
zone labels permuted, seeded by the market seed, before any strategy sees it: each
zone's series takes another label of the same cloud. `--keep-zone-labels` keeps them.

**A private pool** (`PrivateSite`, `with_private`; `--private-gpus N`): the company's own
servers, added to a market for its whole span as one pool of the paid-for market
(`reserved`) on cloud `private`, site and zone `onprem`, instance type `<model>-server`:
ceil(N / GPUs per server) servers, each one instance and one target, all free, at
availability 1 and no interruption rate, the same from the market's start to its end. It
is never drawn: `hazard_schedule` draws spot pools only (pool-wide hits and the rates a
lease's own draw reads), so the market with the pool has the draws of the market without
it. Its price is the marginal price a lease on it pays (`--private-price`, per GPU-hour).

The draws are in draws.py, the private pool in private.py.
"""

from __future__ import annotations

import gzip
import math
import random
import re
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from broker.market.traces import (
    TraceError,
    TraceRow,
    read_trace,
    trace_format,
    write_csv,
    write_jsonl,
)
from broker.model import GPU_MODELS, Market, Offer, PoolKey
from broker.output.stdio import printable

SIM_START = datetime(2026, 11, 30, tzinfo=UTC)
"""Where a generated market's clock starts (fixed, so that runs repeat exactly)."""

SliceId = tuple[str, str]  # (cloud, region)
Change = tuple[PoolKey, Offer | None]  # None: the pool is gone
Progress = Callable[[str], None]


class MarketError(ValueError):
    """A market that cannot be read or generated; the message says where and why."""


MAX_SPAN_DAYS = 731
"""The longest market a backtest replays, in days (two years): a trace whose rows span
more, or a `sim:` duration beyond it, is refused before it is replayed."""
MAX_STEPS = 200_000
"""The most simulated steps (the span over `--step-minutes`) a backtest takes: each
costs time and memory in every strategy's replay and in the interruption draws (a
two-year market at 10-minute steps is 105,264; a year at 1-minute steps, 525,600, is
too many)."""
MAX_MARKET_ROWS = 1_000_000
"""The most rows of a trace a backtest holds in memory (the traces in data/traces have
a few thousand)."""


def span_bound(step_seconds: float) -> tuple[timedelta, str]:
    """The longest span a backtest at `step_seconds` replays, and the sentence that
    says why: MAX_SPAN_DAYS, or fewer days when MAX_STEPS steps of that size end
    sooner."""
    days = timedelta(days=MAX_SPAN_DAYS)
    steps_seconds = MAX_STEPS * step_seconds
    if steps_seconds < days.total_seconds():
        return (timedelta(seconds=steps_seconds),
                f"a backtest takes at most {MAX_STEPS:,} steps (MAX_STEPS) of "
                f"{step_seconds / 60:g} minutes (--step-minutes)")
    return days, f"a backtest replays at most {MAX_SPAN_DAYS} days (MAX_SPAN_DAYS)"


@dataclass(frozen=True, slots=True)
class Step:
    """What changed at one instant, `at` seconds after the market's start."""

    at: float
    slices: tuple[tuple[SliceId, tuple[Change, ...]], ...]


@dataclass(frozen=True, slots=True)
class MarketTrace:
    """A market in steps, from `start` to `end` (exclusive)."""

    source: str
    start: datetime
    end: datetime
    steps: tuple[Step, ...]
    rows: int
    pools: int
    gpu_pools: dict[str, int]
    """Priced pools per GPU model (every pool the trace ever offers)."""
    on_demand_ppg: dict[str, float]
    """The lowest on-demand price per GPU-hour seen per GPU model."""
    seed: int | None = None
    """A generated market's seed (None: read from a trace)."""
    truth: dict[PoolKey, tuple[list[float], list[float]]] | None = None
    """A generated market's hidden truth: per spot pool, the instants (seconds from the
    start) at which its true hazard changed and the hazard (per hour) from then on. None
    for a market read from a trace (which has only what was observed)."""
    zone_labels: str = "generated"
    """`generated` (sim:), `recorded` (a file as it is) or `permuted` (a file whose zone
    labels `relabel_zones` permuted, with `seed`)."""

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()

    @property
    def hours(self) -> float:
        return self.seconds / 3600.0

    def at(self, seconds: float) -> datetime:
        return self.start + timedelta(seconds=seconds)

    def trace_rows(self) -> Iterator[TraceRow]:
        """The market as trace rows again (what `--save-market` writes)."""
        for step in self.steps:
            t = self.at(step.at)
            for _, changes in step.slices:
                for key, offer in changes:
                    yield TraceRow(t=t, pool=key, gone=True) if offer is None \
                        else TraceRow.of(t, offer)

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "start": _iso(self.start), "end": _iso(self.end),
                "hours": round(self.hours, 6), "rows": self.rows, "pools": self.pools,
                "zone_labels": self.zone_labels}


def _iso(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def offer_of(row: TraceRow) -> Offer:
    """The `Offer` a (not gone) trace row describes; observed at the row's `t`."""
    assert row.gpu is not None and row.gpus is not None
    return _offer(row.pool, row.gpu, row.gpus, row.price_per_hour, row.t, row.availability,
                  row.capacity, row.interruption_rate, row.quota_headroom)


def recorded(offer: Offer) -> Offer:
    """`offer` as a trace row keeps it: what reading the row back gives (no vCPUs, RAM or
    quota group), so a generated market and its saved trace replay alike."""
    return _offer(offer.pool, offer.gpu, offer.gpus, offer.price_per_hour,
                  offer.observed_at, offer.availability, offer.capacity,
                  offer.interruption_rate, offer.quota_headroom)


# Many arguments: one argument per Offer field a trace row fills.
def _offer(key: PoolKey, gpu: str, gpus: int, price: float | None, t: datetime,  # noqa: PLR0913
           availability: float | None, capacity: int | None, rate: float | None,
           quota: int | None) -> Offer:
    model = GPU_MODELS.get(gpu)
    return Offer(pool=key, gpu=gpu, gpus=gpus,
                 gpu_memory_gb=model.memory_gb if model else None, vcpus=None,
                 memory_gb=None, price_per_hour=price, observed_at=t,
                 availability=availability, capacity=capacity, interruption_rate=rate,
                 quota_headroom=quota, gpu_known=model is not None)


class _Builder:
    """Groups (t, pool, offer or None) changes, in time order, into steps."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.steps: list[Step] = []
        self.pending: dict[SliceId, list[Change]] = {}
        self.t: datetime | None = None
        self.start: datetime | None = None
        self.rows = 0
        self.seen: dict[PoolKey, str] = {}
        self.on_demand: dict[str, float] = {}

    def add(self, t: datetime, key: PoolKey, offer: Offer | None) -> None:
        if t != self.t:
            if self.t is not None and t < self.t:
                raise MarketError(f"{self.source}: rows must be ordered by time; "
                                  f"{_iso(t)} comes after {_iso(self.t)}")
            self._flush()
            self.t = t
            if self.start is None:
                self.start = t
        self.rows += 1
        self.pending.setdefault((key.cloud, key.region), []).append((key, offer))
        if offer is not None and offer.price_per_hour is not None:
            self.seen.setdefault(key, offer.gpu)
            if key.market is Market.ON_DEMAND:
                ppg = offer.price_per_hour / offer.gpus
                if ppg < self.on_demand.get(offer.gpu, math.inf):
                    self.on_demand[offer.gpu] = ppg

    def _flush(self) -> None:
        if self.t is not None and self.pending:
            assert self.start is not None
            self.steps.append(Step((self.t - self.start).total_seconds(),
                                   tuple((s, tuple(c)) for s, c in self.pending.items())))
        self.pending = {}

    def build(self, *, step_seconds: float, end: datetime | None,
              truth: dict[PoolKey, tuple[list[float], list[float]]] | None = None
              ) -> MarketTrace:
        self._flush()
        if self.start is None or self.t is None:
            raise MarketError(f"{self.source}: the market trace has no rows")
        stop = end if end is not None else self.t + timedelta(seconds=step_seconds)
        gpu_pools: dict[str, int] = {}
        for gpu in self.seen.values():
            gpu_pools[gpu] = gpu_pools.get(gpu, 0) + 1
        pools = {k for s in self.steps for _, ch in s.slices for k, _ in ch}
        return MarketTrace(source=self.source, start=self.start, end=stop,
                           steps=tuple(self.steps), rows=self.rows, pools=len(pools),
                           gpu_pools=dict(sorted(gpu_pools.items())),
                           on_demand_ppg=dict(sorted(self.on_demand.items())), truth=truth)


def from_rows(rows: Iterable[TraceRow], *, source: str, step_seconds: float,
              end: datetime | None = None) -> MarketTrace:
    """Group ordered trace rows into steps. The span ends at `end`, or one step after
    the last row (a row's state holds until the next one; the trace does not say when
    the recording stopped)."""
    b = _Builder(source)
    for row in rows:
        b.add(row.t, row.pool, None if row.gone else offer_of(row))
    return b.build(step_seconds=step_seconds, end=end)


def read_market(path: Path, *, step_seconds: float,
                relabel_seed: int | None = None) -> MarketTrace:
    """A recorded market trace (JSON Lines or CSV, optionally gzipped); with
    `relabel_seed`, its zone labels permuted by `relabel_zones`. Raises MarketError
    naming the file and line of a bad row."""
    span, why = span_bound(step_seconds)
    try:
        trace = read_trace(path, max_rows=MAX_MARKET_ROWS, max_span=span, span_bound=why)
        if relabel_seed is None:
            return replace(from_rows(trace, source=str(path),
                                     step_seconds=step_seconds), zone_labels="recorded")
        rows = relabel_zones(list(trace), seed=relabel_seed)
        return replace(from_rows(rows, source=str(path), step_seconds=step_seconds),
                       seed=relabel_seed, zone_labels="permuted")
    except TraceError as err:
        raise MarketError(str(err)) from None


ZoneLabel = tuple[str, str, str]  # (cloud, region, zone)


def zone_permutation(labels: Iterable[ZoneLabel], *, seed: int) -> dict[ZoneLabel, ZoneLabel]:
    """A seeded permutation of zone labels within each cloud: label → the label its
    series takes. The same for the same labels and seed (whatever their order), in every
    process; another seed gives another permutation (of the n! there are)."""
    by_cloud: dict[str, list[ZoneLabel]] = {}
    for label in set(labels):
        by_cloud.setdefault(label[0], []).append(label)
    out: dict[ZoneLabel, ZoneLabel] = {}
    for cloud, zones in sorted(by_cloud.items()):
        zones.sort()
        shuffled = list(zones)
        random.Random(f"zone-labels:{seed}:{cloud}").shuffle(shuffled)
        out.update(zip(zones, shuffled, strict=True))
    return out


def relabel_zones(rows: Sequence[TraceRow], *, seed: int) -> list[TraceRow]:
    """`rows` with each zone's series moved to another zone label of the same cloud
    (`zone_permutation`): every pool of zone z (all instance types, both markets, and its
    `gone` rows) takes the region and zone of the label z maps to. Times, order and
    states are kept, so the market holds the same series, only under other names.

    The permutation is over all the zone labels of a cloud, not within each region:
    region names break ties too (in the 9-zone AWS trace the first region, us-east-1, is
    also the least available one), so permuting within regions would leave that
    advantage. The labels themselves stay as recorded (each region keeps its number of
    zones), and what the strategies compare (GPU models, instance types, prices) moves
    with the series, so a generated workload (`gen:`, which names no region or zone)
    fits the relabelled market as it fits the recorded one. A workload or policy that
    names regions, though, names labels, not the series recorded there: replay it with
    `--keep-zone-labels`."""
    mapping = zone_permutation(((r.pool.cloud, r.pool.region, r.pool.zone) for r in rows),
                               seed=seed)
    out = []
    for r in rows:
        k = r.pool
        _, region, zone = mapping[(k.cloud, k.region, k.zone)]
        out.append(replace(r, pool=k._replace(region=region, zone=zone)))
    return out


def save_market(market: MarketTrace, path: Path) -> int:
    """Write `market` as a trace file, its format from the name (`.jsonl`, `.csv`,
    optionally `.gz`). Returns the rows written."""
    try:
        fmt, gz = trace_format(path)
    except TraceError as err:
        raise MarketError(str(err)) from None
    write = write_jsonl if fmt == "jsonl" else write_csv
    if gz:
        with gzip.open(path, "wt", encoding="utf-8", newline="") as z:
            return write(market.trace_rows(), z)
    with open(path, "w", encoding="utf-8", newline="") as f:
        return write(market.trace_rows(), f)


# --- the simulated market ---------------------------------------------------------------

_SIM_SPEC = re.compile(r"^sim:(\d+(?:\.\d+)?)([dhm])(?::(-?\d+))?(?::(\d+))?$")
_UNIT = {"d": 86400.0, "h": 3600.0, "m": 60.0}


@dataclass(frozen=True, slots=True)
class SimSpec:
    """`sim:DURATION[:SEED][:REGIONS]`: DURATION is a number with `d`, `h` or `m`;
    REGIONS is regions per cloud (3 zones each)."""

    seconds: float
    seed: int
    regions_per_cloud: int

    def __str__(self) -> str:
        return f"sim:{_duration(self.seconds)}:{self.seed}:{self.regions_per_cloud}"


def _duration(seconds: float) -> str:
    for unit, size in _UNIT.items():
        if seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds / 60:g}m"


def parse_sim_spec(text: str, *, default_seed: int) -> SimSpec | None:
    """The parsed `sim:...` spec; None when `text` does not start with `sim:`. Raises
    MarketError for a malformed one."""
    if not text.startswith("sim:"):
        return None
    m = _SIM_SPEC.match(text)
    if m is None:
        raise MarketError(f"--market {printable(repr(text), 80)}: expected "
                          "sim:DURATION[:SEED][:REGIONS], "
                          "e.g. sim:7d, sim:36h:42, sim:1d:7:2 (DURATION in d, h or m; "
                          "REGIONS per cloud)")
    seconds = float(m.group(1)) * _UNIT[m.group(2)]
    regions = int(m.group(4)) if m.group(4) else 3
    if seconds <= 0:
        raise MarketError(f"--market {text!r}: the duration must be positive")
    if seconds > MAX_SPAN_DAYS * 86400:
        raise MarketError(f"--market {text!r}: a backtest replays at most {MAX_SPAN_DAYS} "
                          "days (MAX_SPAN_DAYS)")
    if not 1 <= regions <= 100:
        raise MarketError(f"--market {text!r}: REGIONS must be 1..100 per cloud")
    seed = int(m.group(3)) if m.group(3) is not None else default_seed
    return SimSpec(seconds, seed, regions)


def _sync(coro: Coroutine[Any, Any, list[Offer]]) -> list[Offer]:
    """Run a coroutine that never waits (the sim's `poll`) without an event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return list(done.value)
    coro.close()
    raise RuntimeError("the simulated market's poll waited; it must not")


def _state(o: Offer) -> tuple[Any, ...]:
    """What a trace row records of an offer (not when it was observed)."""
    return (o.gpu, o.gpus, o.price_per_hour, o.availability, o.capacity,
            o.interruption_rate, o.quota_headroom)


def simulate_market(spec: SimSpec, *, step_seconds: float,
                    progress: Progress | None = None) -> MarketTrace:
    """Generate a market from the simulated market: every `step_seconds` of simulated
    time, one poll of each region (the sim's injectable clock set to that instant), and
    a row for each pool that is new, changed or gone; beside them, each spot pool's
    hidden true hazard at every poll (`MarketTrace.truth`). No sleeping."""
    from adapters.sim import SimAdapter

    now = [SIM_START]
    sim = SimAdapter(seed=spec.seed, regions_per_cloud=spec.regions_per_cloud,
                     zones_per_region=3, preempt_rate_multiplier=0.0, clock=lambda: now[0])
    regions = sim.regions()
    last: dict[str, dict[PoolKey, tuple[Any, ...]]] = {r: {} for r in regions}
    n = max(1, math.ceil(spec.seconds / step_seconds - 1e-9))
    b = _Builder(str(spec))
    days = math.ceil(spec.seconds / 86400 - 1e-9)
    day = -1
    truth: dict[PoolKey, tuple[list[float], list[float]]] = {}
    for k in range(n):
        t = SIM_START + timedelta(seconds=k * step_seconds)
        now[0] = t
        if progress is not None and int(k * step_seconds // 86400) != day:
            day = int(k * step_seconds // 86400)
            progress(f"generating the simulated market: day {day + 1}/{days}")
        for region in regions:
            before = last[region]
            current: dict[PoolKey, tuple[Any, ...]] = {}
            for offer in _sync(sim.poll(region)):
                state = _state(offer)
                current[offer.pool] = state
                if before.get(offer.pool) != state:
                    b.add(t, offer.pool, recorded(offer))
            for key in before:
                if key not in current:
                    b.add(t, key, None)
            last[region] = current
            at = k * step_seconds
            for key, rate in sim.true_rates(region):
                seen = truth.get(key)
                if seen is None:
                    truth[key] = ([at], [rate])
                elif seen[1][-1] != rate:
                    seen[0].append(at)
                    seen[1].append(rate)
    return replace(b.build(step_seconds=step_seconds,
                           end=SIM_START + timedelta(seconds=spec.seconds), truth=truth),
                   seed=spec.seed)


def load_market(text: str, *, seed: int, step_seconds: float,
                progress: Progress | None = None,
                keep_zone_labels: bool = False) -> MarketTrace:
    """`--market`: `sim:...` or a trace file, whose zone labels are permuted with `seed`
    (`relabel_zones`) unless `keep_zone_labels`."""
    spec = parse_sim_spec(text, default_seed=seed)
    if spec is not None:
        span, why = span_bound(step_seconds)
        if spec.seconds > span.total_seconds():
            raise MarketError(f"--market {text!r}: {spec.seconds / 86400:g} days is longer "
                              f"than {span.total_seconds() / 86400:g} days: {why}")
        return simulate_market(spec, step_seconds=step_seconds, progress=progress)
    return read_market(Path(text), step_seconds=step_seconds,
                       relabel_seed=None if keep_zone_labels else seed)
