"""The simulated market: a seeded, deterministic multi-cloud GPU market.

`SimAdapter` implements the `CloudAdapter` contract for several clouds at once (AWS, GCP,
Azure, Alibaba by default). It drives `gpubroker demo`, most tests and the benchmark, so
it behaves like the real thing where the broker can tell the difference:

* **Catalog.** Instance types, GPUs, vCPUs, RAM and on-demand list prices come from the
  real price snapshot in `tests/fixtures/prices`, copied into this module (`CATALOG`
  below names the file of every number); Alibaba, which the snapshot lacks, uses
  approximate public list prices.
* **Regions and zones.** Real region names per cloud (then synthesized ones, so a
  benchmark can ask for hundreds), real-looking zone names, a small fixed price multiplier
  per region, and a seeded subset (about 85%) of the catalog offered in each zone.
* **Markets.** On-demand pools are steady: list price, high availability, a capacity
  that wanders, no interruption rate. Spot pools move: the discount does a mean-reverting
  random walk around a per-pool base discount, a hidden capacity pressure rises and falls
  (now and then a pool loses all capacity for a few polls), and with it the pool's
  hidden interruption hazard.
* **Hidden truth.** A spot pool's true hazard (interruptions per hour of one instance) is
  `(0.01 + 0.29 (1 - a)^2) × b × exp(w)`: `a` the hidden capacity pressure (an AR(1) pull
  towards a per-pool level), `b` a persistent pool factor (lognormal, median 1, drawn once)
  that no signal shows, `w` the hazard's own AR(1) log-noise; an outage makes it
  `_OUTAGE_RATE`. `true_interruption_rate` gives it; nothing in an offer does.
* **Observation.** What a spot offer reports is the cloud's signal of that truth: lagged
  (`_SIGNALS`: the state of one to three polls ago), noisy (the capacity pressure seen
  through Gaussian noise; the factor `b` and the noise `w` not at all), quantised the way
  the cloud publishes it, and missing (`None`) on about `_MISSING` of polls.
  Each cloud publishes what the real one does, and the offer's `interruption_rate` is
  what the one interruption model (`adapters.hazard`, as the real adapters use it)
  reads from it, over the cloud's trailing window:

  - AWS: `availability` a spot placement score 1-10 in tenths; the Spot Instance
    Advisor band (`<5%`, `5-10%`, `10-15%`, `15-20%`, `>20%`) of the share reclaimed over
    730 h.
  - Azure: the eviction-rate band (`0-5`, `5-10`, `10-15`, `15-20`, `20+` %) over
    28 days; `availability` a three-level placement score (High 0.9, Medium 0.5,
    Low 0.1).
  - GCP: the capacity advice (`adapters/gcp/advice.py`): `availability` its
    `obtainability` (0..1, two decimals); the hazard read from its `estimatedUptime`,
    the time half of the Spot VMs outlive (2 significant digits of real time).
  - Alibaba: the `DescribeSpotAdvice` release rate (`InterruptionRate`, % to 0.1) over
    30 days; `availability` the stock category (`WithStock` 1.0, `ClosedWithStock` 0.3,
    `WithoutStock` 0.0).

  This market is far more eventful than a real one (so that a week's backtest has
  something to tell): an hour here holds about a real month's reclaims (`_TIME_SCALE`,
  730), so a cloud's window of W hours is W / 730 hours here — AWS's band is the share
  reclaimed within an hour, Azure's within 0.92 h, Alibaba's within 0.99 h — and the
  reported rates are per hour of this market, like the hidden truth. The capacity a
  spot offer reports is lagged too.
* **Signals.** `signals()` preempts leased spot pools at random, at their hidden true
  hazard (times `preempt_rate_multiplier`), and passes on signals injected by
  `interrupt`.

**Determinism.** The market of one region depends only on `(seed, region, number of
polls of that region)`: each region has its own `random.Random`, seeded from a stable
hash (never Python's salted `hash()`), so the order in which regions are polled and the
wall clock change nothing. `observed_at` comes from the injectable `clock`. The control
methods (`withdraw`, `set_spot_price`, `interrupt`) and preemptions change what a poll
reports, never the random walk underneath, so a market returns to its seeded course once
an override ends.

Region ids are `"<cloud>:<region>"` (`aws:us-east-1`) because one adapter serves several
clouds; the offers' `PoolKey` carry the plain `cloud="aws", region="us-east-1"`.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import math
import random
from array import array
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType
from typing import ClassVar, Final

from adapters.base import CloudAdapter, LeasedPools
from adapters.errors import InvalidConfig
from adapters.gpus import canonical, memory_gb
from adapters.hazard import (
    WINDOW_HOURS,
    hazard_from_band,
    hazard_from_percent,
    hazard_from_uptime,
)
from broker.model import CapacitySignal, Market, Offer, PoolKey, SignalKind, utcnow

__all__ = ["CATALOG", "CLOUDS", "REGION_NAMES", "SimAdapter", "SimInstanceType"]


@dataclass(frozen=True, slots=True)
class SimInstanceType:
    """One GPU instance type of the simulated catalog.

    `on_demand_per_hour` is the public on-demand list price (USD per instance and hour)
    in the cloud's first region of `REGION_NAMES`; other regions apply a multiplier.
    `spot_per_hour` is the snapshot's spot price in that region, used only to set how
    deep the simulated spot discount runs (`None`: no usable snapshot value).
    `spot_unpriced_share` is the share of zones whose spot pool is listed without a price
    (as the snapshot shows for p4de). `gpu_memory_gb` is set only for GPU models that
    `adapters.gpus` does not know; known models take their memory from there.
    """

    cloud: str
    instance_type: str
    gpu: str
    gpus: int
    vcpus: int
    memory_gb: float
    on_demand_per_hour: float
    spot_per_hour: float | None
    spot_unpriced_share: float = 0.0
    gpu_memory_gb: float | None = None


_T = SimInstanceType

CATALOG: Final[tuple[SimInstanceType, ...]] = (
    # --- AWS: gpu-prices-aws.csv, region us-east-1; spot from zone use1-az1. ---
    _T("aws", "p3.2xlarge", "V100-16GB", 1, 8, 61, 3.06, 0.5197),
    _T("aws", "p3.8xlarge", "V100-16GB", 4, 32, 244, 12.24, 1.8029),
    _T("aws", "p4d.24xlarge", "A100-40GB", 8, 96, 1152, 32.7726, 6.7915),
    # p4de: the snapshot has no spot price in use1-az1/2/3/5, one in use1-az4 (7.8074).
    _T("aws", "p4de.24xlarge", "A100-80GB", 8, 96, 1152, 40.96575, 7.8074,
       spot_unpriced_share=0.5),
    _T("aws", "p5.48xlarge", "H100-80GB", 8, 192, 2048, 98.32, 30.326),
    _T("aws", "g5.xlarge", "A10G", 1, 4, 16, 1.006, 0.4177),
    _T("aws", "g5.12xlarge", "A10G", 4, 48, 192, 5.672, 1.9937),
    _T("aws", "g5.48xlarge", "A10G", 8, 192, 768, 16.288, 3.9266),
    _T("aws", "g6.xlarge", "L4", 1, 4, 16, 0.8048, 0.4155),
    _T("aws", "g6.12xlarge", "L4", 4, 48, 192, 4.6016, 1.9438),
    _T("aws", "g6e.xlarge", "L40S", 1, 4, 32, 1.861, 0.7945),
    _T("aws", "g6e.12xlarge", "L40S", 4, 48, 384, 10.49264, 4.2359),
    _T("aws", "g4dn.xlarge", "T4", 1, 4, 16, 0.526, 0.201),
    _T("aws", "g4dn.12xlarge", "T4", 4, 48, 192, 3.912, 1.5152),
    # --- GCP: gpu-prices-gcp.csv, zone us-central1-a. Full price = host row + accelerator
    # row (same zone, gpu, gpus), written below as `host + accelerator`. ---
    _T("gcp", "a2-highgpu-1g", "A100-40GB", 1, 12, 85,
       0.73948 + 2.93391, 0.29576 + 1.1472),
    _T("gcp", "a2-highgpu-2g", "A100-40GB", 2, 24, 170,
       1.47895 + 5.86782, 0.59151 + 2.2944),
    _T("gcp", "a2-highgpu-4g", "A100-40GB", 4, 48, 340,
       2.95791 + 11.73563, 1.18302 + 4.5888),
    _T("gcp", "a2-highgpu-8g", "A100-40GB", 8, 96, 680,
       5.91582 + 23.47126, 2.36604 + 9.1776),
    _T("gcp", "a2-ultragpu-1g", "A100-80GB", 1, 12, 170,
       1.09962 + 1.8462, 0.43983 + 1.5712),
    _T("gcp", "a2-ultragpu-8g", "A100-80GB", 8, 96, 1360,
       8.79698 + 14.76958, 3.51864 + 12.5696),
    _T("gcp", "a3-highgpu-8g", "H100-80GB", 8, 208, 1872,
       9.46006 + 33.60609, 2.17547 + 18.024),
    _T("gcp", "g2-standard-4", "L4", 1, 4, 16, 0.14679 + 0.56004, 0.05874 + 0.2231),
    _T("gcp", "g2-standard-24", "L4", 2, 24, 96, 0.88075 + 1.12008, 0.35242 + 0.4462),
    _T("gcp", "g2-standard-48", "L4", 4, 48, 192, 1.7615 + 2.24016, 0.70483 + 0.8924),
    # --- Azure: gpu-prices-azure.csv, region eastus (Azure prices are per region). ---
    _T("azure", "Standard_NC24ads_A100_v4", "A100-80GB", 1, 24, 220, 3.673, 0.444433),
    _T("azure", "Standard_NC48ads_A100_v4", "A100-80GB", 2, 48, 440, 7.346, 0.888866),
    _T("azure", "Standard_NC96ads_A100_v4", "A100-80GB", 4, 96, 880, 14.692, 1.777732),
    _T("azure", "Standard_ND96asr_v4", "A100-40GB", 8, 96, 900, 27.197, 2.99167),
    _T("azure", "Standard_ND96amsr_A100_v4", "A100-80GB", 8, 96, 1800, 32.77, 3.6047),
    # The snapshot lists 12 GPUs (the real machine has 8) and a spot price equal to
    # on-demand; we use 8 GPUs and the default spot discount.
    _T("azure", "Standard_ND96isr_H100_v5", "H100-80GB", 8, 96, 1900, 98.32, None),
    _T("azure", "Standard_NC4as_T4_v3", "T4", 1, 4, 28, 0.526, 0.062699),
    _T("azure", "Standard_NC64as_T4_v3", "T4", 4, 64, 440, 4.352, 0.518758),
    _T("azure", "Standard_NC6s_v3", "V100-16GB", 1, 6, 112, 3.06, 0.3978),
    _T("azure", "Standard_NC12s_v3", "V100-16GB", 2, 12, 224, 6.12, 0.7956),
    _T("azure", "Standard_NC24s_v3", "V100-16GB", 4, 24, 448, 12.24, 1.5912),
    # --- Alibaba: not in the snapshot. APPROXIMATE public pay-as-you-go list prices in
    # USD for cn-hangzhou (converted from CNY, rounded); good enough for a simulation,
    # not for billing. No spot reference: the default spot discount applies. ---
    _T("alibaba", "ecs.gn6i-c4g1.xlarge", "T4", 1, 4, 15, 0.95, None),
    _T("alibaba", "ecs.gn6v-c8g1.2xlarge", "V100-16GB", 1, 8, 32, 2.75, None),
    _T("alibaba", "ecs.gn6v-c8g1.16xlarge", "V100-16GB", 8, 64, 256, 22.0, None),
    _T("alibaba", "ecs.gn7i-c8g1.2xlarge", "A10", 1, 8, 30, 1.55, None),
    _T("alibaba", "ecs.gn7i-c16g1.4xlarge", "A10", 1, 16, 60, 1.85, None),
    _T("alibaba", "ecs.gn7i-c32g1.32xlarge", "A10", 4, 128, 752, 7.9, None),
    _T("alibaba", "ecs.gn7-c12g1.3xlarge", "A100-40GB", 1, 12, 94, 3.9, None),
    _T("alibaba", "ecs.gn7-c13g1.26xlarge", "A100-40GB", 8, 104, 756, 30.0, None),
    # Alibaba's own PPU accelerator is deliberately a model `adapters.gpus` does not
    # know: its offers carry gpu="PPU", gpu_known=False (memory as the cloud reports it).
    _T("alibaba", "ecs.ebmppu.4xlarge", "PPU", 1, 16, 96, 2.6, None, gpu_memory_gb=96),
)
"""The simulated catalog, every cloud together (see `SimInstanceType`)."""

del _T

CLOUDS: Final[tuple[str, ...]] = ("aws", "gcp", "azure", "alibaba")
"""The clouds the sim can simulate, in their default order."""

REGION_NAMES: Final[MappingProxyType[str, tuple[str, ...]]] = MappingProxyType({
    # gpu-prices-aws.csv regions, the common ones first.
    "aws": (
        "us-east-1", "us-west-2", "eu-west-1", "us-east-2", "us-west-1", "eu-central-1",
        "eu-west-2", "eu-west-3", "eu-north-1", "eu-south-1", "ca-central-1",
        "ap-northeast-1", "ap-northeast-2", "ap-northeast-3", "ap-south-1",
        "ap-southeast-1", "ap-southeast-2", "ap-southeast-3", "ap-east-1", "sa-east-1",
        "me-central-1", "me-south-1", "af-south-1",
    ),
    # gpu-prices-gcp.csv regions, the common ones first.
    "gcp": (
        "us-central1", "europe-west4", "asia-east1", "us-east1", "us-east4", "us-west1",
        "us-west4", "europe-west1", "europe-west2", "europe-west3", "asia-northeast1",
        "asia-southeast1", "asia-south1", "australia-southeast1", "us-east5",
        "us-south1", "us-west2", "us-west3", "europe-west6", "europe-west8",
        "europe-west9", "europe-central2", "europe-north1", "asia-east2",
        "asia-northeast3", "asia-south2", "asia-southeast2", "me-central2", "me-west1",
        "northamerica-northeast1", "northamerica-northeast2", "southamerica-east1",
    ),
    "azure": (
        "eastus", "westus2", "westeurope", "eastus2", "southcentralus", "westus3",
        "centralus", "northcentralus", "westus", "northeurope", "uksouth",
        "francecentral", "germanywestcentral", "swedencentral", "japaneast",
        "koreacentral", "australiaeast", "southeastasia", "centralindia",
        "canadacentral", "brazilsouth",
    ),
    "alibaba": (
        "cn-hangzhou", "cn-beijing", "ap-southeast-1", "cn-shanghai", "cn-shenzhen",
        "cn-zhangjiakou", "cn-wulanchabu", "cn-hongkong", "ap-northeast-1",
        "ap-southeast-5", "eu-central-1", "us-west-1", "us-east-1",
    ),
})
"""Real region names per cloud; regions beyond these are synthesized (`sim-aws-r042`)."""

# First zone letter of Alibaba regions whose zones do not start at "a" (real layouts).
_ALIBABA_FIRST_ZONE: Final[MappingProxyType[str, str]] = MappingProxyType({
    "cn-hangzhou": "h", "cn-shanghai": "l", "cn-shenzhen": "d", "cn-beijing": "g",
})

# Share of (zone, instance type) pairs a zone offers.
_OFFERED_SHARE: Final = 0.85
# Spot discount: per-pool base within this range, random walk clipped to the wider one.
_BASE_DISCOUNT: Final = (0.30, 0.70)
_DISCOUNT_RANGE: Final = (0.10, 0.85)
_DEFAULT_DISCOUNT: Final = 0.50
# Spot interruption rate per hour from the capacity pressure, availability 1 (low) to 0
# (high): the part of the hazard a cloud's signal reflects.
_RATE_RANGE: Final = (0.01, 0.30)
# The hidden truth: the hazard of one instance is clipped to this range (per hour); an
# outage reclaims running instances at `_OUTAGE_RATE` (most within its few polls).
_TRUE_RATE_RANGE: Final = (0.002, 1.5)
_OUTAGE_RATE: Final = 1.5
# The persistent pool factor: lognormal with this sigma (median 1).
_BIAS_SIGMA: Final = 0.5
# The hazard's own log-noise: AR(1) coefficient and innovation sd per poll.
_WOBBLE: Final = (0.8, 0.25)
# The signal: sd of the noise on the capacity pressure it sees; chance per poll and
# signal that it is missing.
_OBS_NOISE: Final = 0.08
_MISSING: Final = 0.03
# Chance per poll that a spot pool loses all capacity, and for how many polls.
_OUTAGE_CHANCE: Final = 0.004
_OUTAGE_POLLS: Final = (2, 5)
# Polls a spot pool stays scarce after a preemption.
_SCARCE_POLLS: Final = 4
_MAX_ZONES: Final = 26
# The sim's clock: its market is far more eventful than a real one (so that a week's
# backtest has something to tell): an hour here holds about a real month (730 h) of
# reclaims. A cloud's trailing window of W real hours is W / _TIME_SCALE hours here.
_TIME_SCALE: Final = 730.0


def _stable_seed(*parts: object) -> int:
    """A 64-bit seed from `parts`, the same in every process (unlike `hash()`)."""
    text = "\x1f".join(str(p) for p in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _clip(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x


def _banded(cloud: str, labels: Sequence[str], edges_pct: Sequence[float]
            ) -> Callable[[float], float]:
    """A cloud that publishes a band of the share of spot instances reclaimed over its
    trailing window: a hazard (per sim hour) → the share reclaimed within the window
    (`_window`) → the band of `labels` it falls in (`edges_pct` between them) → the
    hazard the one interruption model reads from that band (`hazard_from_band`)."""
    window = _window(cloud)
    rates = []
    for label in labels:
        rate = hazard_from_band(label, window)
        assert rate is not None, label
        rates.append(rate)
    edges = [-math.log1p(-e / 100) / window for e in edges_pct]

    def publish(rate: float) -> float:
        return rates[bisect.bisect_right(edges, rate)]

    return publish


def _release_rate(cloud: str) -> Callable[[float], float]:
    """A cloud that publishes the share reclaimed over its trailing window in % (to
    0.1 %, Alibaba's `InterruptionRate`): a hazard (per sim hour) → that percentage →
    the hazard the one interruption model reads from it (`hazard_from_percent`)."""
    window = _window(cloud)

    def publish(rate: float) -> float:
        return hazard_from_percent(round(-math.expm1(-rate * window) * 100, 1), window)

    return publish


def _uptime(rate: float) -> float:
    """GCP: the capacity advice's `estimatedUptime` of a Spot VM, the time half of the
    VMs outlive (ln 2 / the hazard), published as a Duration in whole seconds of real
    time, given here to 2 significant digits (a real month is an hour here) → the
    hazard the one interruption model reads from it (`hazard_from_uptime`), per sim
    hour."""
    real_hours = float(f"{math.log(2) / rate * _TIME_SCALE:.2g}")
    return hazard_from_uptime(real_hours / _TIME_SCALE)


def _obtainability(a: float) -> float:
    """GCP: the capacity advice's `obtainability`, 0..1 to two decimals."""
    return round(a, 2)


def _window(cloud: str) -> float:
    """The cloud's trailing window (`adapters.hazard.WINDOW_HOURS`) in sim hours."""
    return WINDOW_HOURS[cloud] / _TIME_SCALE


def _score_tenths(a: float) -> float:
    """AWS: a spot placement score 1-10, as availability in tenths."""
    return max(1, min(10, round(a * 10))) / 10


def _score_three(a: float) -> float:
    """Azure: a placement score High / Medium / Low."""
    return 0.9 if a >= 0.65 else 0.5 if a >= 0.35 else 0.1


def _stock(a: float) -> float:
    """Alibaba: WithStock 1.0, ClosedWithStock 0.3, WithoutStock 0.0."""
    return 1.0 if a >= 0.45 else 0.3 if a >= 0.15 else 0.0


@dataclass(frozen=True, slots=True)
class _Signal:
    """How one cloud shows a spot pool's state: `lag` polls late; availability and rate
    quantised (None: the cloud publishes no such signal)."""

    lag: int
    availability: Callable[[float], float] | None
    rate: Callable[[float], float] | None


_SIGNALS: Final[MappingProxyType[str, _Signal]] = MappingProxyType({
    "aws": _Signal(2, _score_tenths, _banded(
        "aws", ("<5%", "5-10%", "10-15%", "15-20%", ">20%"), (5, 10, 15, 20))),
    "azure": _Signal(3, _score_three, _banded(
        "azure", ("0-5", "5-10", "10-15", "15-20", "20+"), (5, 10, 15, 20))),
    "gcp": _Signal(1, _obtainability, _uptime),
    "alibaba": _Signal(2, _stock, _release_rate("alibaba")),
})
"""Each cloud's spot signal (see the module docstring)."""


def _region_name(cloud: str, index: int) -> str:
    """The `index`-th (0-based) region name of `cloud`: real ones, then synthesized."""
    real = REGION_NAMES[cloud]
    return real[index] if index < len(real) else f"sim-{cloud}-r{index + 1:03d}"


def _zone_names(cloud: str, region: str, count: int) -> tuple[str, ...]:
    """Zone names in each cloud's style: `us-east-1a`, `us-central1-a`, `eastus-1`,
    `cn-hangzhou-h`."""
    if cloud == "azure":
        return tuple(f"{region}-{i + 1}" for i in range(count))
    first = ord(_ALIBABA_FIRST_ZONE.get(region, "a")) - ord("a") if cloud == "alibaba" else 0
    letters = [chr(ord("a") + (first + i) % 26) for i in range(count)]
    sep = "" if cloud == "aws" else "-"
    return tuple(f"{region}{sep}{letter}" for letter in letters)


def _price_multiplier(cloud: str, region: str, index: int) -> float:
    """A small, fixed price multiplier per region: 1.0 in the cloud's first region (where
    the catalog's prices were read), 1.00-1.25 elsewhere. Independent of the seed."""
    if index == 0:
        return 1.0
    return 1.0 + (_stable_seed("price", cloud, region) % 26) / 100


def _rate_for(avail: float) -> float:
    """The hazard the capacity pressure alone gives (what a signal reflects)."""
    lo, hi = _RATE_RANGE
    return lo + (hi - lo) * (1.0 - avail) ** 2


def _true_rate(avail: float, bias: float, wobble: float, outage: int) -> float:
    """A spot pool's hidden true hazard (see the module docstring)."""
    if outage > 0:
        return _OUTAGE_RATE
    return _clip(_rate_for(avail) * bias * math.exp(wobble), *_TRUE_RATE_RANGE)


_NONE: Final = math.nan
"""A signal the cloud does not show this poll, in the float columns (`_RegionMarket`)."""


class _RegionMarket:
    """One region's simulated market: its pools, its random stream, its overrides.

    The pools and the random stream depend only on (seed, cloud, region); each `step`
    advances them by one poll. The overrides (`withdrawn`, `pinned`, `scarce`) come from
    the control methods and preemptions; they change reports, not the random stream.

    A pool is an index into columns, one array per quantity, not an object with a float
    object per quantity: a benchmark's market holds tens of thousands of pools, and the
    daemon that runs it keeps them in its memory. What never changes about a pool is
    `keys`, `specs`, `gpus` (canonical model, known, memory), `list_price`, `spot`,
    `priced`, `bias`, `cap_scale`, `base_avail`, `base_discount`. For a spot pool,
    `avail`, `capacity`, `outage` and `true_rate` are the hidden truth; `obs_avail`,
    `obs_rate`, `obs_capacity` what the cloud's signal shows of it (see the module
    docstring; `_NONE` where it shows nothing), set by each `step` from `history`: the
    (capacity pressure, capacity, outage) columns of the last `signal.lag` + 1 polls,
    oldest first.
    """

    def __init__(self, *, seed: int, cloud: str, region: str, index: int,
                 zones_per_region: int) -> None:
        self.cloud = cloud
        self.region = region
        self.signal = signal = _SIGNALS[cloud]
        self.rng = random.Random(_stable_seed("region", seed, cloud, region))
        rng = self.rng
        multiplier = _price_multiplier(cloud, region, index)
        keys: list[PoolKey] = []
        specs: list[SimInstanceType] = []
        models: list[tuple[str, bool, float | None]] = []
        self.list_price, self.cap_scale = array("d"), array("d")
        self.base_avail, self.base_discount, self.bias = array("d"), array("d"), array("d")
        self.avail, self.capacity, self.discount = array("d"), array("d"), array("d")
        self.wobble, self.true_rate, self.outage = array("d"), array("d"), array("i")
        self.obs_avail, self.obs_rate, self.obs_capacity = array("d"), array("d"), array("d")
        spot_flags, priced_flags = bytearray(), bytearray()
        model_of: dict[str, tuple[str, bool, float | None]] = {}
        for zone in _zone_names(cloud, region, zones_per_region):
            for spec in CATALOG:
                if spec.cloud != cloud or rng.random() >= _OFFERED_SHARE:
                    continue
                price = spec.on_demand_per_hour * multiplier
                model = model_of.get(spec.instance_type)
                if model is None:
                    gpu, known = canonical(spec.gpu)
                    model = model_of[spec.instance_type] = (
                        gpu, known, memory_gb(gpu) if known else spec.gpu_memory_gb)
                for market in (Market.ON_DEMAND, Market.SPOT):
                    keys.append(PoolKey(cloud, region, zone, spec.instance_type, market))
                    specs.append(spec)
                    models.append(model)
                    spot = market is Market.SPOT
                    spot_flags.append(spot)
                    priced_flags.append(self._add(len(keys) - 1, spec, price, spot))
        self.keys: tuple[PoolKey, ...] = tuple(keys)
        self.specs: tuple[SimInstanceType, ...] = tuple(specs)
        self.models: tuple[tuple[str, bool, float | None], ...] = tuple(models)
        self.spot, self.priced = bytes(spot_flags), bytes(priced_flags)
        self.by_key: dict[PoolKey, int] = {k: i for i, k in enumerate(self.keys)}
        self.history: deque[tuple[array[float], array[float], array[int]]] = deque(
            [(array("d", self.avail), array("d", self.capacity), array("i", self.outage))],
            maxlen=signal.lag + 1)
        # Quota headroom in GPUs, per market, for the whole region (the markets it sells,
        # in a fixed order: the draws, and so the whole market, follow from the seed).
        sold = (Market.SPOT, Market.ON_DEMAND)
        self.quota_max = {m: rng.choice((64, 128, 256, 512, 1024)) for m in sold}
        self.quota = {m: float(q) * rng.uniform(0.5, 1.0) for m, q in self.quota_max.items()}
        self.quota_group = {m: f"{cloud}:{region}:{m.value}" for m in sold}
        self.withdrawn: set[PoolKey] = set()
        self.pinned: dict[PoolKey, float] = {}
        self.scarce: dict[PoolKey, int] = {}

    def _add(self, i: int, spec: SimInstanceType, price: float, spot: bool) -> bool:
        """Draw pool `i`'s lasting traits and first state into the columns (in the
        random stream's order); whether a spot pool is listed with a price."""
        rng = self.rng
        self.list_price.append(price)
        # Typical free instances: many small ones, few 8-GPU machines.
        cap_scale = rng.uniform(16.0, 160.0) / spec.gpus
        self.cap_scale.append(cap_scale)
        priced = True
        if spot:
            ref = (1.0 - spec.spot_per_hour / spec.on_demand_per_hour
                   if spec.spot_per_hour is not None else _DEFAULT_DISCOUNT)
            discount = _clip(ref + rng.uniform(-0.1, 0.1), *_BASE_DISCOUNT)
            avail = rng.uniform(0.45, 0.95)
            priced = rng.random() >= spec.spot_unpriced_share
            bias = math.exp(rng.gauss(0.0, _BIAS_SIGMA))
        else:
            discount, avail, bias = 0.0, 0.96, 1.0
        capacity = cap_scale * avail
        self.base_discount.append(discount)
        self.discount.append(discount)
        self.base_avail.append(avail)
        self.avail.append(avail)
        self.bias.append(bias)
        self.wobble.append(0.0)
        self.capacity.append(capacity)
        self.outage.append(0)
        self.true_rate.append(_true_rate(avail, bias, 0.0, 0) if spot else 0.0)
        self.obs_avail.append(_NONE)
        self.obs_rate.append(_NONE)
        self.obs_capacity.append(capacity)
        if spot:
            self._observe(i, avail, capacity, False)
        return priced

    def _observe(self, i: int, a: float, capacity: float, outage: bool) -> None:
        """What the cloud's signal shows of pool `i` now: the state (`a`, `capacity`,
        `outage`) of `lag` polls ago, seen through noise, quantised, sometimes missing."""
        rng, signal = self.rng, self.signal
        self.obs_capacity[i] = capacity
        noisy = 0.0 if outage else _clip(a + rng.gauss(0.0, _OBS_NOISE), 0.0, 1.0)
        missing = rng.random()
        self.obs_avail[i] = _NONE if signal.availability is None or missing < _MISSING \
            else signal.availability(noisy)
        self.obs_rate[i] = _NONE if signal.rate is None or _MISSING <= missing < 2 * _MISSING \
            else signal.rate(_RATE_RANGE[1] if outage else _rate_for(noisy))

    def step(self) -> None:
        """Advance every pool one poll, in order: each one's draws from the region's
        random stream, then what its signal shows."""
        rng = self.rng
        for market, top in self.quota_max.items():
            self.quota[market] = _clip(self.quota[market] + rng.gauss(0.0, top * 0.03),
                                       0.0, float(top))
        gauss, uniform = rng.gauss, rng.random
        avail, capacity, discount, wobble = self.avail, self.capacity, self.discount, \
            self.wobble
        outage, true_rate, cap_scale = self.outage, self.true_rate, self.cap_scale
        base_avail, base_discount, bias = self.base_avail, self.base_discount, self.bias
        history, lag = self.history, self.signal.lag
        # The state `lag` polls ago (this poll's own when `lag` is 0), as each pool
        # stepped then.
        seen = history[-min(lag, len(history))] if lag else (avail, capacity, outage)
        keep, sd = _WOBBLE
        for i, spot in enumerate(self.spot):
            if not spot:
                a = avail[i]
                avail[i] = _clip(a + 0.2 * (0.96 - a) + gauss(0.0, 0.01), 0.9, 1.0)
                scale = cap_scale[i]
                capacity[i] = _clip(capacity[i] + gauss(0.0, 0.1 * scale),
                                    0.3 * scale, 1.5 * scale)
                continue
            out = outage[i]
            if out > 0:
                out -= 1
            elif uniform() < _OUTAGE_CHANCE:
                out = rng.randint(*_OUTAGE_POLLS)
            outage[i] = out
            d = discount[i]
            discount[i] = _clip(d + 0.15 * (base_discount[i] - d) + gauss(0.0, 0.03),
                                *_DISCOUNT_RANGE)
            a = avail[i]
            avail[i] = a = _clip(a + 0.2 * (base_avail[i] - a) + gauss(0.0, 0.08), 0.0, 1.0)
            wobble[i] = w = keep * wobble[i] + gauss(0.0, sd)
            # Capacity follows the pressure, noisily, and is gone when the pressure is
            # high.
            level = a * cap_scale[i] * (0.5 + uniform())
            capacity[i] = 0.0 if out > 0 or a < 0.15 else level
            true_rate[i] = _true_rate(a, bias[i], w, out)
            self._observe(i, seen[0][i], seen[1][i], seen[2][i] > 0)
        history.append((array("d", avail), array("d", capacity), array("i", outage)))

    def offers(self, observed_at: datetime) -> list[Offer]:
        """The current state as offers, overrides applied; ages the scarce overrides."""
        quota = {m: int(q) for m, q in self.quota.items()}
        qgroup = self.quota_group
        od_quota, od_group = quota[Market.ON_DEMAND], qgroup[Market.ON_DEMAND]
        spot_quota, spot_group = quota[Market.SPOT], qgroup[Market.SPOT]
        withdrawn, pinned, scarce = self.withdrawn, self.pinned, self.scarce
        signal = self.signal
        list_price, priced, discount = self.list_price, self.priced, self.discount
        obs_avail, obs_rate, obs_capacity = self.obs_avail, self.obs_rate, self.obs_capacity
        out: list[Offer] = []
        append = out.append
        for i, (key, spec, (gpu, known, gpu_memory), spot) in enumerate(
                zip(self.keys, self.specs, self.models, self.spot, strict=True)):
            if withdrawn and key in withdrawn:
                continue
            if not spot:
                append(Offer(key, gpu, spec.gpus, gpu_memory, spec.vcpus, spec.memory_gb,
                             round(list_price[i], 6), observed_at, round(self.avail[i], 4),
                             int(self.capacity[i]), None, od_quota, known, od_group,
                             spec.gpus))
                continue
            price: float | None = None
            if key in pinned:
                price = pinned[key]
            elif priced[i]:
                price = round(list_price[i] * (1.0 - discount[i]), 6)
            avail: float | None = obs_avail[i]
            rate: float | None = obs_rate[i]
            avail = None if avail != avail else avail  # _NONE
            rate = None if rate != rate else rate
            capacity = int(obs_capacity[i])
            if key in scarce:
                capacity = 0
                avail = None if avail is None else min(avail, 0.1)
                if rate is not None and signal.rate is not None:
                    rate = max(rate, signal.rate(0.25))
            append(Offer(key, gpu, spec.gpus, gpu_memory, spec.vcpus, spec.memory_gb,
                         price, observed_at, avail, capacity, rate, spot_quota, known,
                         spot_group, spec.gpus))
        for key in list(scarce):
            scarce[key] -= 1
            if scarce[key] <= 0:
                del scarce[key]
        return out


class SimAdapter(CloudAdapter):
    """The simulated multi-cloud market (see the module docstring).

    Arguments (all keyword-only):

    * `seed` - the market's course; same seed and same polls give equal offers.
    * `clouds` - which of `CLOUDS` to simulate.
    * `regions_per_cloud` - regions per cloud: real names first, then synthesized
      `sim-<cloud>-rNNN` ones (83 gives about 20,000 offers in all).
    * `zones_per_region` - zones per region (1..26).
    * `preempt_rate_multiplier` - scales the chance that `signals()` preempts a leased
      spot pool (0 disables preemption; large values make it near-certain each tick).
    * `signal_interval_seconds` - how often `signals()` considers preemptions.
    * `clock` - the time stamped on offers and signals.

    Control methods for tests and the demo: `interrupt`, `withdraw` / `restore`,
    `set_spot_price` / `unpin`, and `offer_count`. Each takes a `PoolKey` of a pool the sim
    offers and raises `ValueError` for any other.

    Raises `ValueError` for bad arguments.
    """

    name: ClassVar[str] = "sim"

    def __init__(
        self,
        *,
        seed: int = 7,
        clouds: Sequence[str] = CLOUDS,
        regions_per_cloud: int = 3,
        zones_per_region: int = 3,
        preempt_rate_multiplier: float = 1.0,
        signal_interval_seconds: float = 1.0,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        if isinstance(clouds, str):
            raise ValueError(f"clouds must be a sequence of cloud names, not the string "
                             f"{clouds!r}")
        unknown = [c for c in clouds if c not in CLOUDS]
        if unknown:
            raise ValueError(f"unknown cloud(s) {', '.join(map(repr, unknown))}: the sim "
                             f"simulates {', '.join(CLOUDS)}")
        if not clouds:
            raise ValueError("clouds must name at least one cloud")
        if len(set(clouds)) != len(clouds):
            raise ValueError(f"clouds lists a cloud twice: {list(clouds)}")
        if not isinstance(regions_per_cloud, int) or regions_per_cloud < 1:
            raise ValueError(f"regions_per_cloud must be a positive integer, "
                             f"got {regions_per_cloud!r}")
        if (not isinstance(zones_per_region, int)
                or not 1 <= zones_per_region <= _MAX_ZONES):
            raise ValueError(f"zones_per_region must be an integer from 1 to {_MAX_ZONES}, "
                             f"got {zones_per_region!r}")
        if not math.isfinite(preempt_rate_multiplier) or preempt_rate_multiplier < 0:
            raise ValueError(f"preempt_rate_multiplier must be a finite number >= 0, "
                             f"got {preempt_rate_multiplier!r}")
        if not math.isfinite(signal_interval_seconds) or signal_interval_seconds <= 0:
            raise ValueError(f"signal_interval_seconds must be a finite number > 0, "
                             f"got {signal_interval_seconds!r}")
        self._seed = seed
        self._zones = zones_per_region
        self._multiplier = preempt_rate_multiplier
        self._interval = signal_interval_seconds
        self._clock = clock
        # region id -> (cloud, region, index within the cloud)
        self._layout: dict[str, tuple[str, str, int]] = {}
        for cloud in clouds:
            for i in range(regions_per_cloud):
                region = _region_name(cloud, i)
                self._layout[f"{cloud}:{region}"] = (cloud, region, i)
        self._markets: dict[str, _RegionMarket] = {}
        self._injected: asyncio.Queue[CapacitySignal] = asyncio.Queue()

    # --- the adapter contract ---------------------------------------------------------

    def regions(self) -> Sequence[str]:
        """Region ids `"<cloud>:<region>"`, cloud by cloud, in the configured order."""
        return tuple(self._layout)

    async def poll(self, region: str) -> list[Offer]:
        """Advance `region`'s market by one step and return its offers: one per (zone,
        instance type, market) the region offers, minus withdrawn pools, all stamped
        `observed_at=clock()`. Raises `InvalidConfig` for a region id not in `regions()`.
        """
        market = self._market(region)
        if market is None:
            raise InvalidConfig(f"the sim has no region {region!r} (ids look like "
                                f"'aws:us-east-1')", cloud="sim", region=region)
        market.step()
        return market.offers(self._clock())

    async def signals(self, leased: LeasedPools) -> AsyncGenerator[CapacitySignal, None]:
        """Yield signals injected by `interrupt` at once, and every
        `signal_interval_seconds` preempt each leased spot pool of the sim with
        probability `true hazard x interval in hours x preempt_rate_multiplier` (the
        pool's hidden true hazard, not the rate its offers report). A preempted pool is
        reported scarce (no capacity, low availability) for the next few polls of its
        region. Pools of other adapters in `leased()` are ignored.
        """
        loop = asyncio.get_running_loop()
        rng = random.Random(_stable_seed("signals", self._seed))
        hours = self._interval / 3600.0
        next_tick = loop.time() + self._interval
        while True:
            while (injected := await self._next_injected(next_tick - loop.time())) is not None:
                yield injected
            now = loop.time()
            next_tick = max(next_tick + self._interval, now)
            for key in sorted(set(leased())):
                if key.market is not Market.SPOT:
                    continue
                found = self._find(key)
                if found is None:
                    continue
                market, i = found
                chance = market.true_rate[i] * hours * self._multiplier
                if rng.random() < chance:
                    market.scarce[key] = _SCARCE_POLLS
                    yield CapacitySignal(key, SignalKind.INTERRUPTED, self._clock(),
                                         "simulated spot preemption")

    async def _next_injected(self, within: float) -> CapacitySignal | None:
        """The next injected signal, waiting at most `within` seconds; None if none."""
        if within <= 0:
            try:
                return self._injected.get_nowait()
            except asyncio.QueueEmpty:
                return None
        try:
            async with asyncio.timeout(within):
                return await self._injected.get()
        except TimeoutError:
            return None

    # --- control methods (tests and the demo) ------------------------------------------

    def interrupt(self, pool: PoolKey, detail: str = "simulated interruption") -> None:
        """Queue an INTERRUPTED signal for `pool`; `signals()` yields it at once. The pool
        is then reported scarce for the next few polls, as after a random preemption."""
        market, _ = self._require(pool)
        market.scarce[pool] = _SCARCE_POLLS
        self._injected.put_nowait(
            CapacitySignal(pool, SignalKind.INTERRUPTED, self._clock(), detail))

    def withdraw(self, pool: PoolKey) -> None:
        """Make `pool` vanish from its region's polls (capacity lost) until `restore`."""
        market, _ = self._require(pool)
        market.withdrawn.add(pool)

    def restore(self, pool: PoolKey) -> None:
        """Undo `withdraw`: the pool is in its region's next poll again."""
        market, _ = self._require(pool)
        market.withdrawn.discard(pool)

    def set_spot_price(self, pool: PoolKey, price_per_hour: float) -> None:
        """Report `price_per_hour` (USD per instance) for spot `pool` in every poll until
        `unpin`, whatever the market does (e.g. to push a leased pool over its cap)."""
        market, _ = self._require(pool)
        if pool.market is not Market.SPOT:
            raise ValueError(f"set_spot_price needs a spot pool, got {pool}")
        if not math.isfinite(price_per_hour) or price_per_hour <= 0:
            raise ValueError(f"price_per_hour must be a finite number > 0, "
                             f"got {price_per_hour!r}")
        market.pinned[pool] = float(price_per_hour)

    def unpin(self, pool: PoolKey) -> None:
        """Undo `set_spot_price`: the pool reports its simulated price again."""
        market, _ = self._require(pool)
        market.pinned.pop(pool, None)

    def offer_count(self) -> int:
        """How many offers one poll of every region returns now (withdrawn pools left
        out). Does not advance any market."""
        total = 0
        for region in self._layout:
            market = self._market(region)
            assert market is not None
            total += len(market.keys) - len(market.withdrawn)
        return total

    def true_interruption_rate(self, pool: PoolKey) -> float | None:
        """The hidden true hazard of spot `pool` now (interruptions per hour of one
        instance), which its offers only hint at; None for an on-demand pool. For
        simulations that judge a strategy (the backtest); a broker never sees it."""
        market, i = self._require(pool)
        return market.true_rate[i] if market.spot[i] else None

    def true_rates(self, region: str) -> list[tuple[PoolKey, float]]:
        """(pool, hidden true hazard) of every spot pool of `region` (a region id) now,
        withdrawn ones included. Raises `InvalidConfig` for an unknown region id."""
        market = self._market(region)
        if market is None:
            raise InvalidConfig(f"the sim has no region {region!r}", cloud="sim",
                                region=region)
        return [(key, rate) for key, rate, spot in
                zip(market.keys, market.true_rate, market.spot, strict=True) if spot]

    # --- internals ---------------------------------------------------------------------

    def _market(self, region_id: str) -> _RegionMarket | None:
        """The region's market, built on first use (building does not advance it)."""
        market = self._markets.get(region_id)
        if market is None:
            where = self._layout.get(region_id)
            if where is None:
                return None
            cloud, region, index = where
            market = _RegionMarket(seed=self._seed, cloud=cloud, region=region, index=index,
                                   zones_per_region=self._zones)
            self._markets[region_id] = market
        return market

    def _find(self, pool: PoolKey) -> tuple[_RegionMarket, int] | None:
        """The pool's region market and its index there; None if the sim has no such pool."""
        market = self._market(f"{pool.cloud}:{pool.region}")
        if market is None:
            return None
        i = market.by_key.get(pool)
        return None if i is None else (market, i)

    def _require(self, pool: PoolKey) -> tuple[_RegionMarket, int]:
        found = self._find(pool)
        if found is None:
            raise ValueError(f"the sim offers no pool {pool}")
        return found
