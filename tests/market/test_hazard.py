"""Tests of the hazard estimator (`broker/market/hazard.py`) on synthetic pool histories whose
long-run levels are known."""

from __future__ import annotations

import math
import random

import pytest
from factories import key, offer

from broker.market.hazard import HazardEstimator
from broker.market.pool import ResourcePool
from broker.model import Market

HOUR = 3600.0
STEP = 600.0  # one poll every ten minutes
A = key("us-east-1a")
B = key("us-east-1b")


def rate_for(avail: float) -> float:
    return 0.01 + 0.29 * (1.0 - avail) ** 2


def wander(rng: random.Random, base: float, steps: int, start: float | None = None
           ) -> list[float]:
    """Availability reverting 20 % a step to `base`, with noise (sd 0.08 a step)."""
    a = base if start is None else start
    out = []
    for _ in range(steps):
        a = min(1.0, max(0.0, a + 0.2 * (base - a) + rng.gauss(0.0, 0.08)))
        out.append(a)
    return out


def feed(h: HazardEstimator, k: object, series: list[float], t0: float = 0.0) -> float:
    t = t0
    for i, a in enumerate(series):
        t = t0 + i * STEP
        h.observe(k, t, rate_for(a), a)  # type: ignore[arg-type]
    return t


def test_it_converges_to_a_pools_long_run_level_not_the_last_poll() -> None:
    rng = random.Random(3)
    h = HazardEstimator(half_life_hours=12.0)
    series = wander(rng, 0.6, 6 * 72)  # three days
    feed(h, A, series)
    level = h.level(A)
    assert level is not None
    rate, avail = level
    assert avail == pytest.approx(0.6, abs=0.04)
    mean_rate = sum(rate_for(a) for a in series[-6 * 24:]) / (6 * 24)
    assert rate == pytest.approx(mean_rate, rel=0.15)
    # Over a job of a few hours the estimate is near the level, whatever the last poll.
    est = h.estimate(A)
    assert est is not None and est[1] is not None
    assert est[1] == pytest.approx(0.6, abs=0.08)


def test_the_estimate_predicts_the_next_hours_better_than_the_last_poll() -> None:
    rng = random.Random(11)
    bases = [rng.uniform(0.45, 0.95) for _ in range(40)]
    series = [wander(rng, b, 6 * 48) for b in bases]
    h = HazardEstimator(half_life_hours=6.0, horizon_hours=3.0)
    err_est = err_now = 0.0
    n = 0
    for i in range(6 * 45):
        for p, s in enumerate(series):
            h.observe(key(f"z{p}"), i * STEP, rate_for(s[i]), s[i])
        if i >= 6 * 12 and i % 6 == 0:
            for p, s in enumerate(series):
                future = sum(rate_for(a) for a in s[i:i + 18]) / 18
                est = h.estimate(key(f"z{p}"))
                assert est is not None and est[0] is not None
                err_est += (est[0] - future) ** 2
                err_now += (rate_for(s[i]) - future) ** 2
                n += 1
    assert math.sqrt(err_est / n) < 0.75 * math.sqrt(err_now / n)
    # The reversion time it learnt: 20 % a ten-minute step is about 45 minutes.
    assert h.reversion_hours == pytest.approx(STEP / HOUR / -math.log(0.8), rel=0.35)


def test_a_new_pool_is_taken_at_its_current_values_then_blended() -> None:
    h = HazardEstimator(half_life_hours=6.0)
    h.observe(A, 0.0, 0.02, 0.9)
    assert h.estimate(A) == pytest.approx((0.02, 0.9))
    # Ten hours at 0.2 / 0.4, then a calm poll: the estimate stays near the history.
    h.observe(A, 60.0, 0.2, 0.4)
    h.observe(A, 10 * HOUR, 0.02, 0.9)
    rate, avail = h.estimate(A)  # type: ignore[misc]
    assert 0.02 < rate < 0.2 and 0.4 < avail < 0.9
    assert avail < 0.65  # mostly the history
    # A pool seen once is its current value; one with no signal stays unknown.
    h.observe(B, 10 * HOUR, None, 0.7)
    assert h.estimate(B) == (None, 0.7)
    assert h.estimate(key("us-east-1c")) is None


def test_the_half_life_sets_how_fast_history_fades() -> None:
    for half_life in (2.0, 8.0):
        h = HazardEstimator(half_life_hours=half_life)
        h.observe(A, 0.0, 0.1, 0.9)
        h.observe(A, 100 * HOUR, 0.1, 0.5)  # a long calm past, then a change
        h.observe(A, (100 + half_life) * HOUR, 0.1, 0.5)
        # After one half-life at 0.5 the average is half way from 0.9.
        avg = h.average(A)
        assert avg is not None
        assert avg[1] == pytest.approx(0.7, abs=1e-3)
    h.half_life_hours = 3.0
    assert h.half_life_hours == pytest.approx(3.0)
    with pytest.raises(ValueError, match="half_life_hours"):
        HazardEstimator(half_life_hours=0.0)


def test_short_horizons_follow_the_present_long_ones_the_level() -> None:
    rng = random.Random(5)
    h = HazardEstimator(half_life_hours=6.0)
    end = feed(h, A, wander(rng, 0.8, 6 * 48))
    h.observe(A, end + STEP, rate_for(0.3), 0.3)  # a bad moment
    now = h.over(A, 0.0)
    soon = h.over(A, 0.5)
    day = h.over(A, 24.0)
    level = h.level(A)
    assert now is not None and soon is not None and day is not None and level is not None
    assert now[1] == pytest.approx(0.3)
    assert now[1] < soon[1] < day[1] < level[1]  # type: ignore[operator]
    assert level[1] == pytest.approx(0.8, abs=0.07)


def test_unchanged_values_need_not_be_fed() -> None:
    every, changes = HazardEstimator(), HazardEstimator()
    values = [(0.05, 0.7)] * 10 + [(0.2, 0.3)] * 7 + [(0.01, 0.95)] * 30
    last = None
    for i, (r, a) in enumerate(values):
        every.observe(A, i * STEP, r, a)
        if (r, a) != last:
            changes.observe(A, i * STEP, r, a)
            last = (r, a)
    changes.observe(B, (len(values) - 1) * STEP, 0.1, 0.5)  # the clock moves on
    every.observe(B, (len(values) - 1) * STEP, 0.1, 0.5)
    every.refresh()
    changes.refresh()
    assert every.estimate(A) == pytest.approx(changes.estimate(A))
    assert every.average(A) == pytest.approx(changes.average(A))


def test_a_gone_or_stocked_out_pool_counts_as_unavailable() -> None:
    h = HazardEstimator(half_life_hours=6.0)
    h.observe(A, 0.0, 0.02, 0.9)
    h.observe(A, 6 * HOUR, 0.3, 0.0)  # a stock-out: nothing runs, its rate is not averaged
    h.observe(A, 12 * HOUR, 0.02, 0.9)
    # Six hours at 0.9 then six at 0: weights 1/4 and 1/2 of the history (normalised).
    assert h.average(A) == pytest.approx((0.02, (0.25 * 0.9 + 0.5 * 0.0) / 0.75))
    h.gone(A, 13 * HOUR)
    assert h.estimate(A) is None and A in h
    h.observe(A, 19 * HOUR, 0.02, 0.9)
    back = h.average(A)
    assert back is not None and back[0] == pytest.approx(0.02)
    assert back[1] is not None and back[1] < 0.3


def test_memory_is_bounded_by_forgetting_pools_gone_long() -> None:
    h = HazardEstimator(forget_after_hours=24.0, refresh_seconds=STEP)
    for n in range(100):
        h.observe(key(f"z{n}"), 0.0, 0.05, 0.7)
    for n in range(90):
        h.gone(key(f"z{n}"), HOUR)
    h.observe(A, 20 * HOUR, 0.05, 0.7)
    assert len(h) == 101
    h.observe(A, 26 * HOUR, 0.06, 0.7)
    assert len(h) == 11
    assert key("z0") not in h and key("z95") in h


def test_it_is_fed_by_a_pools_changes_spot_only() -> None:
    from factories import Clock

    clock = Clock()
    pool = ResourcePool(stale_after_seconds=1e9, clock=clock)
    h = HazardEstimator()
    unsubscribe = pool.feed_hazard(h)
    spot = offer("us-east-1a", availability=0.6, interruption_rate=0.08)
    od = offer("us-east-1a", market=Market.ON_DEMAND, availability=0.95)
    pool.replace(("aws", "us-east-1"), [spot, od])
    assert h.estimate(spot.pool) == pytest.approx((0.08, 0.6))
    assert h.estimate(od.pool) is None
    clock.advance(600)
    pool.replace(("aws", "us-east-1"), [od])
    assert h.estimate(spot.pool) is None and spot.pool in h
    unsubscribe()


def test_a_view_over_another_horizon_answers_as_over_does() -> None:
    """`at(h)` answers `over(key, h)` as of the last refresh, and for a pool just fed, as
    of then; views made late start from the pools' history like the estimator's own."""
    from broker.market.hazard import HORIZONS, horizon_bucket

    rng = random.Random(9)
    h = HazardEstimator(half_life_hours=6.0, refresh_seconds=1800.0)
    assert h.at(h.horizon_hours) is h
    early = h.at(1.0)
    feed(h, A, wander(rng, 0.7, 6 * 12))
    end = feed(h, B, wander(rng, 0.5, 6 * 12), t0=300.0)
    late = h.at(64.0)
    h.refresh()
    for view, hours in ((early, 1.0), (late, 64.0)):
        assert view.refreshes == h.refreshes
        for k in (A, B):
            got, want = view.estimate(k), h.over(k, hours)
            assert got is not None and want is not None
            assert got == pytest.approx(want)
    h.observe(A, end + STEP, rate_for(0.2), 0.2)
    est = early.estimate(A)
    assert est == pytest.approx(h.over(A, 1.0, now=end + STEP))
    assert est is not None and est[1] is not None and est[1] < 0.5  # the short one follows it
    h.gone(B, end + 2 * STEP)
    assert early.estimate(B) is None and late.estimate(B) is None
    assert [horizon_bucket(d) for d in (None, 0, 0.1, 1.9, 3, 6, 12, 30, 1000)] == \
        [4.0, 4.0, 1.0, 1.0, 4.0, 4.0, 16.0, 16.0, 64.0]
    assert set(HORIZONS) == {1.0, 4.0, 16.0, 64.0}
