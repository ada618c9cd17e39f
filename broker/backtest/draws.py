"""The interruption draws every strategy shares: per pool and step, seeded, so that the
strategies of one comparison meet the same interruptions (`hazard_schedule`)."""

from __future__ import annotations

import bisect
import hashlib
import math
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from broker.backtest.market import MarketTrace
from broker.model import Market, PoolKey


def _pool_hash(seed: int, key: PoolKey) -> Any:
    text = f"{seed}\x1f{key.cloud}\x1f{key.region}\x1f{key.zone}\x1f{key.instance_type}" \
           f"\x1f{key.market.value}\x1f"
    return hashlib.blake2b(text.encode(), digest_size=16)


def _draw(prefix: Any, k: int) -> tuple[float, float]:
    h = prefix.copy()
    h.update(str(k).encode())
    d = h.digest()
    return (int.from_bytes(d[:8], "big") / 2.0**64, int.from_bytes(d[8:], "big") / 2.0**64)


def uniforms(seed: int, key: PoolKey, k: int) -> tuple[float, float]:
    """Two uniforms in [0, 1) for pool `key` in step `k`: a stable hash (BLAKE2b) of the
    three, the same in every process, for every strategy and in any order of asking."""
    return _draw(_pool_hash(seed, key), k)

POOL_WIDE_SHARE = 0.25
"""The share of a spot pool's hazard that is pool-wide (a capacity reclaim hitting every
lease on the pool at once); the rest strikes each instance on its own."""

CORRELATED_POOL_WIDE_SHARE = 0.9
"""The correlated market variant's pool-wide share (`--pool-wide-share`): interruptions
are mostly capacity reclaims that take every lease of a pool at once, so a gang is
hardly riskier than one instance, unlike what gang scoring (n × the rate) assumes."""

HIDDEN_FACTOR_SIGMA = 0.5
"""A market read from a file has no hidden truth: its draws use each pool's observed
rate (or the default) times a hidden factor, lognormal with median 1 and this σ (the
simulated market's persistent pool factor has the same), drawn once per pool from the
draw seed (`hidden_factor`). A strategy sees the rate; the draws follow the rate times
a factor no strategy sees, so replaying a trace that carries rates is no replay of
the truth."""

TRUTH_GENERATED = "the simulated market's hidden true hazard"
TRUTH_FACTOR = (f"each row's rate (or the default) × a hidden per-pool factor "
                f"(lognormal, median 1, σ {HIDDEN_FACTOR_SIGMA:g})")


def hidden_factor(seed: int, key: PoolKey) -> float:
    """The hidden factor of pool `key` under draw seed `seed` (`HIDDEN_FACTOR_SIGMA`): a
    stable hash, the same in every process."""
    h = hashlib.blake2b(f"factor\x1f{seed}\x1f{key.cloud}\x1f{key.region}\x1f{key.zone}"
                        f"\x1f{key.instance_type}".encode(), digest_size=8).digest()
    u = (int.from_bytes(h, "big") + 0.5) / 2.0**64
    return math.exp(HIDDEN_FACTOR_SIGMA * statistics.NormalDist().inv_cdf(u))


def _lease_draw(prefix: Any, k: int, job: int) -> tuple[float, float]:
    h = prefix.copy()
    h.update(f"{k}\x1f{job}".encode())
    d = h.digest()
    return (int.from_bytes(d[:8], "big") / 2.0**64, int.from_bytes(d[8:], "big") / 2.0**64)


def lease_uniforms(seed: int, key: PoolKey, k: int, job: int) -> tuple[float, float]:
    """Two uniforms in [0, 1) for job `job`'s lease on pool `key` in step `k`: a stable
    hash of the four, independent of the pool-wide draw `uniforms(seed, key, k)`."""
    return _lease_draw(_pool_hash(seed, key), k, job)


@dataclass(slots=True)
class HazardSchedule:
    """The interruption draws of a market (see the module docstring): the pool-wide
    hits, and what a lease meets (`lease_hit`). Pure functions of the market and the
    seed: the same for every strategy, in any order of asking."""

    seed: int
    step_seconds: float
    pool_hits: list[tuple[float, PoolKey]]
    """Every pool-wide (instant, spot pool) interruption, in time order."""
    rates: dict[PoolKey, tuple[list[int], list[float]]]
    """Per spot pool: the steps from which its rate changed, and the rate (per hour)."""
    hidden: bool
    """The rates are the generated market's hidden truth (else the rows' observed rates
    times each pool's `hidden_factor`)."""
    pool_wide_share: float = POOL_WIDE_SHARE
    _prefixes: dict[PoolKey, Any] = field(default_factory=dict)

    @property
    def truth(self) -> str:
        """What the draws follow, for the report."""
        return TRUTH_GENERATED if self.hidden else TRUTH_FACTOR

    def __iter__(self) -> Iterator[tuple[float, PoolKey]]:
        return iter(self.pool_hits)

    def rate(self, key: PoolKey, k: int) -> float:
        """The pool's interruption rate (per hour, one instance) in step k; 0 when it
        is no spot pool offered then."""
        found = self.rates.get(key)
        if found is None:
            return 0.0
        steps, rates = found
        i = bisect.bisect_right(steps, k) - 1
        return rates[i] if i >= 0 else 0.0

    def lease_hit(self, key: PoolKey, k: int, job: int, instances: int) -> float | None:
        """When, in seconds from the start, a lease of `instances` instances held by job
        `job` on `key` is interrupted in step k by its own draw; None if it is not."""
        rate = self.rate(key, k)
        if rate <= 0:
            return None
        prefix = self._prefixes.get(key)
        if prefix is None:
            prefix = self._prefixes[key] = _pool_hash(self.seed, key)
        u, v = _lease_draw(prefix, k, job)
        share = 1.0 - self.pool_wide_share
        if u < -math.expm1(-share * rate * instances * self.step_seconds / 3600.0):
            return (k + v) * self.step_seconds
        return None


def _advance(steps: Sequence[Any], i: int, t_k: float, spot: dict[PoolKey, float],
             gone: list[PoolKey], default_rate: float) -> int:
    """The market's steps up to `t_k` applied to the spot pools offered (`spot`: their
    observed rates); the pools no longer offered are added to `gone`. The next step's
    index."""
    while i < len(steps) and steps[i].at <= t_k:
        for _, changes in steps[i].slices:
            for key, offer in changes:
                if key.market is not Market.SPOT:
                    continue
                if offer is None:
                    if spot.pop(key, None) is not None:
                        gone.append(key)
                else:
                    rate = offer.interruption_rate
                    spot[key] = default_rate if rate is None else rate
        i += 1
    return i


def _true_rate(known: tuple[list[float], list[float]], key: PoolKey,
               cursor: dict[PoolKey, int], t_k: float) -> float:
    """The hidden truth's rate of a pool at `t_k` (`cursor`: where each pool's reading
    stands, moved forward)."""
    times, values = known
    j = cursor.get(key, 0)
    while j + 1 < len(times) and times[j + 1] <= t_k:
        j += 1
    cursor[key] = j
    return values[j]


def hazard_schedule(market: MarketTrace, *, seed: int, step_seconds: float,
                    default_rate: float, pool_wide_share: float = POOL_WIDE_SHARE
                    ) -> HazardSchedule:
    """The interruption draws of `market` (see the module docstring): the hidden truth's
    rates when the market has it, else the rows' (`default_rate` for a spot row without
    one) times each pool's `hidden_factor`. The same for every strategy by
    construction."""
    pool_hits: list[tuple[float, PoolKey]] = []
    spot: dict[PoolKey, float] = {}
    prefixes: dict[PoolKey, Any] = {}
    rates: dict[PoolKey, tuple[list[int], list[float]]] = {}
    truth = market.truth
    cursor: dict[PoolKey, int] = {}
    factors: dict[PoolKey, float] = {}
    gone: list[PoolKey] = []
    steps = market.steps
    i = 0
    hours = step_seconds / 3600.0
    ticks = max(1, math.ceil(market.seconds / step_seconds - 1e-9))
    for k in range(ticks):
        t_k = k * step_seconds
        i = _advance(steps, i, t_k, spot, gone, default_rate)
        for key in gone:  # not offered from this step on: no rate
            if key not in spot and (seen := rates.get(key)) is not None and seen[1][-1]:
                seen[0].append(k)
                seen[1].append(0.0)
        gone.clear()
        hits = []
        for key, observed in spot.items():
            if truth is not None and (known := truth.get(key)) is not None:
                rate = _true_rate(known, key, cursor, t_k)
            else:
                factor = factors.get(key)
                if factor is None:
                    factor = factors[key] = hidden_factor(seed, key)
                rate = observed * factor
            seen = rates.get(key)
            if seen is None:
                rates[key] = ([k], [rate])
            elif seen[1][-1] != rate:
                seen[0].append(k)
                seen[1].append(rate)
            if rate <= 0:
                continue
            prefix = prefixes.get(key)
            if prefix is None:
                prefix = prefixes[key] = _pool_hash(seed, key)
            u, v = _draw(prefix, k)
            if u < -math.expm1(-pool_wide_share * rate * hours):
                hits.append((t_k + v * step_seconds, key))
        hits.sort()
        pool_hits.extend(hits)
    return HazardSchedule(seed, step_seconds, pool_hits, rates, truth is not None,
                          pool_wide_share, prefixes)
