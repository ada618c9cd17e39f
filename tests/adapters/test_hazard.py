"""The one interruption model: a published reclaimed share over a window → the hazard."""

from __future__ import annotations

import math

import pytest

from adapters import hazard
from adapters.hazard import (
    ALIBABA_WINDOW_HOURS,
    AWS_WINDOW_HOURS,
    AZURE_WINDOW_HOURS,
    band_share,
    hazard_from_band,
    hazard_from_share,
    hazard_from_uptime,
)

AWS_BANDS = ("<5%", "5-10%", "10-15%", "15-20%", ">20%")
AZURE_BANDS = ("0-5", "5-10", "10-15", "15-20", "20+")
ALIBABA_BANDS = ("0-3%", "3-5%", "5-10%", "10-100%")


def test_the_windows_are_the_clouds_trailing_month() -> None:
    assert AWS_WINDOW_HOURS == 730.0
    assert AZURE_WINDOW_HOURS == 28 * 24
    assert ALIBABA_WINDOW_HOURS == 30 * 24
    assert dict(hazard.WINDOW_HOURS) == {"aws": 730.0, "azure": 672.0, "alibaba": 720.0}


@pytest.mark.parametrize(("share", "window"), [(0.025, 730.0), (0.25, 672.0), (0.5, 1.0),
                                               (0.075, 720.0)])
def test_a_share_reads_back_as_the_chance_within_its_window(share: float,
                                                            window: float) -> None:
    rate = hazard_from_share(share, window)
    assert rate == pytest.approx(-math.log(1 - share) / window, rel=1e-3)
    assert 1 - math.exp(-rate * window) == pytest.approx(share, rel=1e-3)


def test_no_share_no_hazard_and_a_whole_share_a_bounded_one() -> None:
    assert hazard_from_share(0.0, 730) == 0.0
    assert hazard_from_share(-0.1, 730) == 0.0
    top = hazard_from_share(1.0, 730)
    assert math.isfinite(top) and top == pytest.approx(math.log(100) / 730, rel=1e-3)
    assert hazard_from_share(1.5, 730) == top == hazard_from_share(0.99, 730)


@pytest.mark.parametrize(("share", "window"), [(math.nan, 730), (0.1, 0), (0.1, -1),
                                               (0.1, math.inf)])
def test_garbage_is_refused(share: float, window: float) -> None:
    with pytest.raises(ValueError):
        hazard_from_share(share, window)


@pytest.mark.parametrize(("label", "share"), [
    ("<5%", 0.025), ("5-10%", 0.075), ("10-15%", 0.125), ("15-20%", 0.175),
    (">20%", 0.25),  # open: 20 % + one 5-point step
    ("0-5", 0.025), ("20+", 0.25), (" 20 + ", 0.25), ("0-5%", 0.025),
    ("0-3%", 0.015), ("3-5%", 0.04), ("10-100%", 0.15),  # reaches 100 %: open, 10 % + 5
    (" 5 - 10 % ", 0.075), ("<2.5%", 0.0125),
    ("", None), (None, None), ("5%", None), ("5-%", None), ("<%", None), ("high", None),
    ("N/A", None), ("10-5%", None),
])
def test_a_band_stands_for_its_midpoint_or_above_its_open_bound(label: str | None,
                                                                share: float | None) -> None:
    assert band_share(label) == share


@pytest.mark.parametrize(("bands", "window"), [(AWS_BANDS, AWS_WINDOW_HOURS),
                                               (AZURE_BANDS, AZURE_WINDOW_HOURS),
                                               (ALIBABA_BANDS, ALIBABA_WINDOW_HOURS)])
def test_each_clouds_bands_rise_and_stay_a_month_apart(bands: tuple[str, ...],
                                                       window: float) -> None:
    rates = [hazard_from_band(b, window) for b in bands]
    assert all(r is not None for r in rates)
    assert rates == sorted(rates) and len(set(rates)) == len(rates)
    # a month's reclaims: the lowest band well under one per thousand hours, the top one
    # (open) below 1e-3 too
    assert 1e-5 < rates[0] < 1e-4 and rates[-1] < 1e-3  # type: ignore[operator]


def test_the_same_band_on_aws_and_azure_is_the_same_hazard_within_the_window_ratio() -> None:
    for aws, azure in zip(AWS_BANDS, AZURE_BANDS, strict=True):
        a, z = hazard_from_band(aws, AWS_WINDOW_HOURS), hazard_from_band(azure,
                                                                         AZURE_WINDOW_HOURS)
        assert a is not None and z is not None
        assert z / a == pytest.approx(730 / 672, rel=2e-3)


def test_the_share_is_monotone() -> None:
    shares = [i / 100 for i in range(0, 101)]
    rates = [hazard_from_share(p, ALIBABA_WINDOW_HOURS) for p in shares]
    assert rates == sorted(rates)


def test_an_uptime_most_instances_outlive_is_their_median() -> None:
    assert hazard_from_uptime(1.0) == pytest.approx(math.log(2), rel=1e-3)
    assert hazard_from_uptime(10 / 60) == pytest.approx(6 * math.log(2), rel=1e-3)
    assert hazard_from_uptime(1.0) == hazard_from_share(0.5, 1.0)
    with pytest.raises(ValueError):
        hazard_from_uptime(0)
