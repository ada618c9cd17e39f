"""What a spot pool's interruption rate and availability will be over a job, from history.

A pool's signals at one poll are a noisy sample: a pool that looks calm now may be one
that is usually short of capacity, and over a job of a few hours its usual level counts
more than the moment. `HazardEstimator` keeps, per spot pool, a **time-weighted moving
average** of the interruption rate and of the availability it has been seen with, and
answers what they will be on average over a job.

**Fed with changes.** `observe(key, t, rate, availability)` when a pool shows new
signals, `gone(key, t)` when it is no longer offered (`observe_change` takes a
`PoolChange`, `observe_row` a trace row). A value holds from its observation until the
next one, so an unchanged value needs no call: the average integrates it when the next
change comes (a pool's average is exact however rarely it changes). While a pool is gone
or stocked out (availability 0) its availability counts as 0 and its interruption rate
is not averaged (nothing runs there). Each call is a few dict operations and one `exp`.

**The average** of a signal x over the pool's history, with half-life h
(τ = h / ln 2), is `m = ∫ x(s) e^{−(t−s)/τ} ds / ∫ e^{−(t−s)/τ} ds` over the time the
pool has been seen; `w = 1 − e^{−T/τ}` (T: that time) says how much history it holds.

**The long-run level** blends `m` with the current value x₀: the history is worth
`τ·w / θ` looks at the pool and the current value one, where θ is how long a deviation
from the pool's level lasts (below), so

    level = b·m + (1 − b)·x₀,   b = τ·w / (τ·w + θ)

A new pool (w = 0) is taken at its current value, as without history; after a few θ of
history, mostly at its average.

**Over a horizon H** (hours), a deviation from the level that fades as e^{−s/θ}
averages to the share `g = θ/H · (1 − e^{−H/θ})` of itself, so

    expected over H = level + g · (x₀ − level)

(H → 0: the current value; H ≫ θ: the level). θ is learnt from the pools' availability:
the correlation ρ of consecutive deviations from the pools' averages, Δt apart, gives
θ = −Δt / ln ρ (`reversion_hours` until enough pairs are seen; stock-outs, availability
0, are left out: they are not the pool's usual wander).

`estimate(key)` answers for `horizon_hours`, from a table brought up to date on each of
the pool's changes and for every pool each `refresh_seconds` of the fed clock: one dict
lookup, for placement's inner loop. **A request's own horizon**: `at(hours)` is a view
answering for that horizon (placement asks for `horizon_bucket(duration_hours)`: 1, 4, 16
or 64 hours, the nearest on a log scale, so that at most four tables are kept, each
made on first use and then kept up to date like the first). `over(key, hours)` computes
any horizon exactly. Memory:
one small record per spot pool seen; pools gone longer than `forget_after_hours` are
dropped. Pure: no I/O, no clock of its own (times are seconds on the caller's clock,
non-decreasing per pool; an earlier time counts as the latest one).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from broker.market.changes import PoolChange
from broker.model import Market, PoolKey

if TYPE_CHECKING:
    from broker.market.traces import TraceRow

Estimate = tuple[float | None, float | None]
"""(interruption rate per hour, availability); None where the pool never showed one."""

HORIZONS: tuple[float, ...] = (1.0, 4.0, 16.0, 64.0)
"""The horizons (hours) placement scores requests over: one per request, by its duration."""
DEFAULT_HORIZON = 4.0
"""A request that gives no `duration_hours` is scored over this horizon."""


def horizon_bucket(duration_hours: float | None) -> float:
    """The horizon of `HORIZONS` nearest (on a log scale) to a request's duration."""
    if duration_hours is None or not duration_hours > 0:
        return DEFAULT_HORIZON
    x = math.log(duration_hours)
    return min(HORIZONS, key=lambda h: abs(math.log(h) - x))


class Hazard(Protocol):
    """What placement reads of an estimator: the estimate per pool for one horizon, and
    how often every estimate was refreshed (a cache of costs is out of date then)."""

    @property
    def refreshes(self) -> int: ...

    def estimate(self, key: PoolKey) -> Estimate | None: ...


class HazardView:
    """`HazardEstimator.at(hours)`: its estimates over another horizon (kept up to date
    by the estimator with its own)."""

    __slots__ = ("_est", "_g", "horizon_hours", "owner")

    def __init__(self, owner: HazardEstimator, hours: float, g: float) -> None:
        self.owner = owner
        self.horizon_hours = hours
        self._g = g
        self._est: dict[PoolKey, Estimate] = {}

    @property
    def refreshes(self) -> int:
        return self.owner.refreshes

    def estimate(self, key: PoolKey) -> Estimate | None:
        return self._est.get(key)


_MIN_PAIRS = 50
_MAX_PAIRS = 20_000  # then the sums are halved: θ follows the market slowly
_MAX_PAIR_GAP = 6 * 3600.0
_MIN_HISTORY = 3600.0  # seconds of a pool's history before its deviations count for θ


class _Pool:
    __slots__ = ("avail", "gone_at", "m_avail", "m_rate", "rate", "t", "w_avail", "w_rate")

    def __init__(self, t: float, rate: float | None, avail: float | None) -> None:
        self.t = t
        self.rate = rate
        self.avail = avail
        self.m_rate = rate if rate is not None else 0.0
        self.m_avail = avail if avail is not None else 0.0
        self.w_rate = 0.0
        self.w_avail = 0.0
        self.gone_at: float | None = None


def _blend(m: float, w: float, x0: float, tau_h: float, theta: float, g: float) -> float:
    eff = tau_h * w
    level = x0 if eff <= 0 else (eff * m + theta * x0) / (eff + theta)
    return level + g * (x0 - level)


def _fade(theta: float, hours: float) -> float:
    """The share of a deviation left on average over `hours` (see the module docstring)."""
    if hours <= 0:
        return 1.0
    x = hours / theta
    return -math.expm1(-x) / x


class HazardEstimator:
    """Per spot pool: the time-weighted average interruption rate and availability, and
    their expected values over a job (see the module docstring)."""

    def __init__(self, *, half_life_hours: float = 6.0, horizon_hours: float = 4.0,
                 reversion_hours: float = 1.0, forget_after_hours: float = 48.0,
                 refresh_seconds: float = 600.0) -> None:
        if not half_life_hours > 0:
            raise ValueError(f"half_life_hours must be > 0, got {half_life_hours!r}")
        if not reversion_hours > 0:
            raise ValueError(f"reversion_hours must be > 0, got {reversion_hours!r}")
        self._tau = 0.0
        self.half_life_hours = half_life_hours
        self.horizon_hours = max(0.0, horizon_hours)
        self.default_reversion_hours = reversion_hours
        self.forget_after = forget_after_hours * 3600.0
        self.refresh_seconds = refresh_seconds
        self.now = -math.inf
        self._pools: dict[PoolKey, _Pool] = {}
        self._est: dict[PoolKey, Estimate] = {}
        self._views: dict[float, HazardView] = {}
        self.refreshes = 0
        """How many times `refresh` re-estimated every pool (a cache of costs computed
        from the estimates is out of date when it changes; other estimates change only
        with the pool changes that carry them)."""
        self._refreshed = -math.inf
        self._theta = reversion_hours
        self._g = _fade(reversion_hours, self.horizon_hours)
        # Consecutive deviations from the pools' average availability: Σxy, Σx², ΣΔt, n.
        self._sxy = self._sxx = self._sdt = 0.0
        self._pairs = 0

    # --- settings ------------------------------------------------------------------------

    @property
    def half_life_hours(self) -> float:
        return self._tau * math.log(2) / 3600.0

    @half_life_hours.setter
    def half_life_hours(self, hours: float) -> None:
        """A new half-life applies from now on (the averages so far stay)."""
        if not hours > 0:
            raise ValueError(f"half_life_hours must be > 0, got {hours!r}")
        self._tau = hours * 3600.0 / math.log(2)

    @property
    def reversion_hours(self) -> float:
        """θ: how long a pool's deviation from its level lasts, as learnt so far."""
        return self._theta

    def __len__(self) -> int:
        return len(self._pools)

    def __contains__(self, key: object) -> bool:
        return key in self._pools

    # --- feeding -------------------------------------------------------------------------

    def observe(self, key: PoolKey, t: float, rate: float | None,
                availability: float | None) -> None:
        """Pool `key` shows these signals from `t` (seconds) on."""
        p = self._pools.get(key)
        if p is None:
            p = self._pools[key] = _Pool(t, rate, availability)
        else:
            if p.gone_at is None and p.rate == rate and p.avail == availability:
                self._tick(t)
                return
            t = max(t, p.t)
            if p.gone_at is None and availability and p.avail and \
                    0 < t - p.t <= _MAX_PAIR_GAP and p.w_avail * self._tau >= _MIN_HISTORY:
                self._pair(p.avail - p.m_avail, availability - p.m_avail, t - p.t)
            self._accrue(p, t)
            p.rate, p.avail, p.gone_at = rate, availability, None
        self._est[key] = self._estimate(p, self._g, 0.0)
        for v in self._views.values():
            v._est[key] = self._estimate(p, v._g, 0.0)
        self._tick(t)

    def gone(self, key: PoolKey, t: float) -> None:
        """Pool `key` is not offered from `t` on."""
        p = self._pools.get(key)
        if p is None or p.gone_at is not None:
            return
        t = max(t, p.t)
        self._accrue(p, t)
        p.avail, p.gone_at = 0.0, t
        self._est.pop(key, None)
        for v in self._views.values():
            v._est.pop(key, None)
        self._tick(t)

    def observe_change(self, change: PoolChange, t: float) -> None:
        """A poll's changes at `t`: its new and changed spot offers, and the spot pools
        it no longer offers."""
        offers = change.offers
        for key in change.updated:
            if key.market is Market.SPOT:
                o = offers[key]
                self.observe(key, t, o.interruption_rate, o.availability)
        for key in change.removed:
            if key.market is Market.SPOT:
                self.gone(key, t)
        # A poll that changed nothing still moves time on (re-readings of the same
        # state are no change: `broker.market.pool.same_state`).
        self._tick(t)

    def observe_row(self, row: TraceRow) -> None:
        """One row of a market trace (recorded history) of a spot pool."""
        if row.pool.market is not Market.SPOT:
            return
        t = row.t.timestamp()
        if row.gone:
            self.gone(row.pool, t)
        else:
            self.observe(row.pool, t, row.interruption_rate, row.availability)

    def observe_rows(self, rows: Iterable[TraceRow]) -> int:
        """Rows of a trace, in time order; returns how many were read."""
        n = 0
        for row in rows:
            self.observe_row(row)
            n += 1
        return n

    # --- answers -------------------------------------------------------------------------

    def estimate(self, key: PoolKey) -> Estimate | None:
        """The expected interruption rate and availability of `key` over `horizon_hours`
        as of the last refresh (None: a pool not seen, or gone)."""
        return self._est.get(key)

    def at(self, hours: float) -> Hazard:
        """The estimates over `hours` instead (`estimate` of the view returned): this
        estimator for its own horizon, else a view kept up to date from now on."""
        if hours == self.horizon_hours:
            return self
        v = self._views.get(hours)
        if v is None:
            v = self._views[hours] = HazardView(self, hours, _fade(self._theta, hours))
            at = self._refreshed  # as of the last refresh, like the estimator's own
            # A copy (one C-level step under the GIL): a view may be made in a worker
            # thread while the loop feeds the estimator.
            for k, p in list(self._pools.items()):
                if p.gone_at is None:
                    v._est[k] = self._estimate(p, v._g, max(0.0, at - p.t))
        return v

    def over(self, key: PoolKey, hours: float, now: float | None = None) -> Estimate | None:
        """The expected interruption rate and availability of `key` over the next `hours`
        from `now` (default: the latest time fed)."""
        p = self._pools.get(key)
        if p is None or p.gone_at is not None:
            return None
        return self._estimate(p, _fade(self._theta, hours),
                              max(0.0, (self.now if now is None else now) - p.t))

    def average(self, key: PoolKey, now: float | None = None) -> Estimate | None:
        """The pool's moving averages `m` as of `now` (default: the latest time fed)."""
        p = self._pools.get(key)
        if p is None:
            return None
        since = max(0.0, (self.now if now is None else now) - p.t)
        m_rate, _, m_avail, _ = self._averages(p, since)
        return (None if p.rate is None else m_rate), (None if p.avail is None else m_avail)

    def level(self, key: PoolKey) -> Estimate | None:
        """The pool's long-run level (the expected value over a long job)."""
        return self.over(key, math.inf)

    def _estimate(self, p: _Pool, g: float, since: float) -> Estimate:
        """`p`'s signals over a horizon whose fade is `g`, its current values having
        held for `since` more seconds than it has integrated."""
        m_rate, w_rate, m_avail, w_avail = self._averages(p, since)
        tau_h, theta = self._tau / 3600.0, self._theta
        rate = None if p.rate is None else _blend(m_rate, w_rate, p.rate, tau_h, theta, g)
        avail = None if p.avail is None else _blend(m_avail, w_avail, p.avail, tau_h, theta,
                                                    g)
        return rate, avail

    def _averages(self, p: _Pool, since: float) -> tuple[float, float, float, float]:
        """`p`'s averages and weights (rate, then availability) with its current values
        held `since` seconds more than it has integrated; `p` is left as it is."""
        m_rate, w_rate, m_avail, w_avail = p.m_rate, p.w_rate, p.m_avail, p.w_avail
        if since > 0:
            a = -math.expm1(-since / self._tau)
            if p.rate is not None and p.avail != 0 and p.gone_at is None:
                w = w_rate + a * (1.0 - w_rate)
                m_rate += a * (p.rate - m_rate) / w
                w_rate = w
            if p.avail is not None:
                w = w_avail + a * (1.0 - w_avail)
                m_avail += a * (p.avail - m_avail) / w
                w_avail = w
        return m_rate, w_rate, m_avail, w_avail

    # --- upkeep --------------------------------------------------------------------------

    def _accrue(self, p: _Pool, t: float) -> None:
        """Fold the values `p` held since its last update into its averages."""
        dt = t - p.t
        if dt <= 0:
            return
        a = -math.expm1(-dt / self._tau)
        if p.rate is not None and p.avail != 0:  # nothing runs in a stock-out (or gone)
            w = p.w_rate + a * (1.0 - p.w_rate)
            p.m_rate += a * (p.rate - p.m_rate) / w
            p.w_rate = w
        if p.avail is not None:
            w = p.w_avail + a * (1.0 - p.w_avail)
            p.m_avail += a * (p.avail - p.m_avail) / w
            p.w_avail = w
        p.t = t

    def _pair(self, x: float, y: float, dt: float) -> None:
        if self._pairs >= _MAX_PAIRS:
            self._sxy, self._sxx, self._sdt = self._sxy / 2, self._sxx / 2, self._sdt / 2
            self._pairs //= 2
        self._sxy += x * y
        self._sxx += x * x
        self._sdt += dt
        self._pairs += 1

    def _tick(self, t: float) -> None:
        if t > self.now:
            self.now = t
        if t - self._refreshed >= self.refresh_seconds:
            self.refresh()

    def refresh(self) -> None:
        """Learn θ again, bring every pool's estimate up to the latest time fed and forget
        pools gone too long (done by the feeding itself every `refresh_seconds`)."""
        now = self.now
        self._refreshed = now
        self.refreshes += 1
        if self._pairs >= _MIN_PAIRS and self._sxx > 0:
            rho = self._sxy / self._sxx
            if 0 < rho < 1:
                dt_h = self._sdt / self._pairs / 3600.0
                self._theta = min(max(-dt_h / math.log(rho), 1 / 60), self._tau / 3600.0)
        g = self._g = _fade(self._theta, self.horizon_hours)
        est = self._est
        forget = [k for k, p in self._pools.items()
                  if p.gone_at is not None and now - p.gone_at > self.forget_after]
        for k in forget:
            del self._pools[k]
        views = list(self._views.values())
        for v in views:
            v._g = _fade(self._theta, v.horizon_hours)
        for k, p in self._pools.items():
            if p.gone_at is None:
                since = max(0.0, now - p.t)
                est[k] = self._estimate(p, g, since)
                for v in views:
                    v._est[k] = self._estimate(p, v._g, since)
