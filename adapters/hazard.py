"""The one interruption model: what the clouds publish about spot reclaims, as the hazard
of a spot instance (interruptions per hour, `Offer.interruption_rate`).

AWS, Azure and Alibaba each publish the share of spot instances they reclaimed over a
trailing window of about a month, as a band or a percentage. Read naively, each in its
own horizon, the same share gives hazards a thousand times apart; read here, in one
model, a pool reclaimed as often on two clouds scores the same hazard on both.

**The model.** A spot instance is reclaimed at a constant hazard λ per hour, so the
chance that it is reclaimed within a window of W hours is p = 1 − exp(−λ·W). A published
share p over W hours is read as that chance, so

    λ = −ln(1 − p) / W                                    (`hazard_from_share`)

p is clamped to [0, `MAX_SHARE`]: a share of 100 % (or a cloud's error above it) gives a
finite hazard, −ln(0.01) / W, not infinity. Hazards are given to 4 significant digits.

**Bands.** A band stands for one share (`band_share`):

* a closed band `lo-hi` (`5-10%`, `5-10`) and `<hi` (`<5%`, read as `0-hi`): its
  midpoint, the best single guess when nothing says where in the band a pool sits;
* an open top band (`>20%`, `20+`, and Alibaba's `10-100%`, which says only "above
  10 %"): its lower bound plus `OPEN_BAND_STEP` (5 points: `>20%` → 25 %, `10-100%` →
  15 %), i.e. the midpoint of a band twice as wide as the 5-point bands below it. Such a
  band is clearly worse than the one below it, but its midpoint (60 %, 55 %) would score
  every pool in it like an outage; the pools in it spread upwards from its bound, and
  the band tells no more.

**Each cloud's window** (`*_WINDOW_HOURS`, stated once, with its source, below; the
simulator and the README's table use the same constants).

**GCP** publishes no share: its capacity advice (`advice.capacity`) gives an
`obtainability` score 0..1 (the chance that a request for VMs succeeds: availability,
not a hazard) and an `estimatedUptime`, "the estimated run time of the majority of Spot
VMs in the request before preemption". That is a time most VMs outlive, a median, not a
mean: half of them reclaimed by it, `hazard_from_uptime(hours)` = ln 2 / hours (the
same model: a share of ½ over that window).

This module imports nothing of the project, so that every adapter may import it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

__all__ = [
    "ALIBABA_WINDOW_HOURS", "AWS_WINDOW_HOURS", "AZURE_WINDOW_HOURS", "MAX_SHARE",
    "OPEN_BAND_STEP", "WINDOW_HOURS", "band_share", "hazard_from_band",
    "hazard_from_percent", "hazard_from_share", "hazard_from_uptime",
]

# --- each cloud's window -------------------------------------------------------------

AWS_WINDOW_HOURS: Final = 730.0
"""AWS Spot Instance Advisor: "Frequency of interruption represents the rate at which
Spot has reclaimed capacity during the trailing month" — a month, 8,760 h / 12."""

AZURE_WINDOW_HOURS: Final = 28 * 24.0
"""Azure Spot eviction rates (Resource Graph `SpotResources`,
`microsoft.compute/skuspotevictionrate/location`): the eviction rate band of a size in a
region "based on the last 28 trailing days"."""

ALIBABA_WINDOW_HOURS: Final = 30 * 24.0
"""Alibaba `DescribeSpotAdvice`: `InterruptionRate`, "the average release rate of spot
instances in the last 30 days" (%), and its band `InterruptRateDesc`."""

WINDOW_HOURS: Final[Mapping[str, float]] = MappingProxyType({
    "aws": AWS_WINDOW_HOURS, "azure": AZURE_WINDOW_HOURS, "alibaba": ALIBABA_WINDOW_HOURS,
})
"""Cloud → the window (hours) its published reclaimed share covers."""

# --- the conversion --------------------------------------------------------------------

MAX_SHARE: Final = 0.99
"""The largest share read: p → 1 would be an infinite hazard."""

OPEN_BAND_STEP: Final = 0.05
"""An open top band stands for its lower bound plus this share (see the module doc)."""


def hazard_from_share(share: float, window_hours: float) -> float:
    """The hazard (interruptions per hour) of a spot instance from `share` (0..1) of spot
    instances reclaimed within `window_hours`: λ = −ln(1 − p) / W, p clamped to
    [0, `MAX_SHARE`], 4 significant digits. Raises `ValueError` for a share that is not
    a number or a window that is not a positive number of hours."""
    if not math.isfinite(share):
        raise ValueError(f"a reclaimed share must be a number, got {share!r}")
    if not math.isfinite(window_hours) or window_hours <= 0:
        raise ValueError(f"a window must be a positive number of hours, got {window_hours!r}")
    p = min(max(share, 0.0), MAX_SHARE)
    return float(f"{-math.log1p(-p) / window_hours:.4g}") if p > 0 else 0.0


def hazard_from_percent(percent: float, window_hours: float) -> float:
    """`hazard_from_share` for a share given in % (Alibaba's `InterruptionRate`)."""
    return hazard_from_share(percent / 100.0, window_hours)


def hazard_from_uptime(hours: float) -> float:
    """The hazard of a spot instance from a time the majority of instances outlive
    (GCP's `estimatedUptime`, in hours): half reclaimed within it, ln 2 / hours. Raises
    `ValueError` for an uptime that is not a positive number of hours."""
    return hazard_from_share(0.5, hours)


_N = r"\d+(?:\.\d+)?"
_BAND = re.compile(rf"^\s*(?:<\s*(?P<below>{_N})|>\s*(?P<above>{_N})|(?P<plus>{_N})\s*\+"
                   rf"|(?P<lo>{_N})\s*-\s*(?P<hi>{_N}))\s*%?\s*$")


def band_share(label: str | None) -> float | None:
    """The share (0..1) a band label stands for (see the module doc): `<5%` → 0.025,
    `5-10%` / `5-10` → 0.075, `>20%` / `20+` → 0.25, `10-100%` → 0.15. None for no label
    or one that reads as no band (`5%`, `high`, a band upside down)."""
    m = _BAND.match(label or "")
    if m is None:
        return None
    if m["below"] is not None:
        return float(m["below"]) / 200
    open_from = m["above"] or m["plus"]
    if open_from is None:
        lo, hi = float(m["lo"]), float(m["hi"])
        if hi < lo:
            return None
        if hi < 100:
            return (lo + hi) / 200
        open_from = m["lo"]
    return round(float(open_from) / 100 + OPEN_BAND_STEP, 6)


def hazard_from_band(label: str | None, window_hours: float) -> float | None:
    """The hazard a band label stands for (`band_share`) over `window_hours`; None for
    no or an unreadable label."""
    share = band_share(label)
    return None if share is None else hazard_from_share(share, window_hours)
