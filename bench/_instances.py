"""Placement instances built from the real GPU price snapshot (`tests/fixtures/prices`).

A clean function API, for the placement bench and for tests:

    offers = offers_from_snapshot(5000, seed=1)
    teams = teams_for(1000, offers)
    requests = requests_mix(1000, offers, seed=1, teams=teams)
    policy = policy_for(teams)
    pool = pool_from(offers)          # one slice per cloud/region, as the poller fills it
    placement.solve([Ask(r) for r in requests], pool, policy, now=T0)

or all of it at once with `instance(n_requests, n_offers, seed)`.

What is real and what is drawn from a seeded generator:

* real: instance types, GPU models (the snapshot's names mapped onto the canonical ones
  with `adapters.gpus.canonical`), GPUs and vCPUs per instance, regions, zones, on-demand
  and spot prices of AWS, GCP and Azure. One on-demand and one spot pool per row that
  has that price. GCP prices the host VM and the GPUs apart: a pool's price is the host
  row plus the accelerator row of the same zone, GPU and count. The snapshot has no n1
  host rows, so T4, V100, P100 and P4 (which attach to n1 VMs) get an n1-standard host
  of 8 vCPUs per GPU (at most 64) at an approximate list price of $0.0475 per vCPU-hour
  on demand and $0.01 spot. Accelerator rows with no host row (B200) are left out.
  Azure has no zones: the region is the zone, as the Azure adapter does.
* drawn: free capacity (instances; mostly small, 10 % unknown, 10 % zero), availability,
  spot interruption rates (some unknown), and quotas. Quotas follow the clouds' real
  shapes: AWS a vCPU quota per region, family (G, P) and market; GCP a GPU quota per
  region, accelerator and market; Azure a vCPU quota per region and family (on demand)
  and one per region (spot). About 40 % of the quotas are shared by the pools of the
  group (`quota_group`, `quota_units`), about 25 % are per pool, the rest unknown.
* when `n_offers` is below what the snapshot gives, a seeded sample of its pools; when
  above, the snapshot's pools again with a synthetic zone suffix (`use1-az1~2`) and a
  seeded price jitter of ±3 %, as many times as needed.

Requests come in a mix weighted towards what the snapshot offers (see `requests_mix`).
"""

from __future__ import annotations

import csv
import math
import os
import random
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from adapters.gpus import canonical
from broker.market.pool import ResourcePool
from broker.model import Market, Offer, PlaceRequest, PoolKey
from policies.model import Gpus, Policy, Scoring, Team

# the snapshot vendored with the tests (provenance: tests/fixtures/prices/README.md);
# GPUBROKER_PRICE_DATA names another directory holding the same three CSVs
DATA_DIR = Path(
    os.environ.get("GPUBROKER_PRICE_DATA")
    or Path(__file__).resolve().parents[1] / "tests/fixtures/prices"
)
_T = TypeVar("_T")
T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
"""The time every offer is observed at and every bench places at."""

N1_VCPU_HOUR = {Market.ON_DEMAND: 0.0475, Market.SPOT: 0.01}
"""Approximate n1-standard list price per vCPU-hour (the snapshot has no n1 rows)."""
N1_GPUS = frozenset({"T4", "V100", "P100", "P4"})
PRICE_JITTER = 0.03

# What a request asks for: GPUs, weighted towards small; markets; durations (hours).
COUNTS = ((1, 40), (2, 25), (4, 18), (8, 12), (16, 5))
MARKETS = (("spot", 30), ("on_demand", 25), ("any", 30), (None, 15))  # None: policy's
DURATIONS = ((None, 30), (1.0, 15), (2.0, 10), (4.0, 15), (8.0, 15), (24.0, 10), (72.0, 5))
# How much more a model is asked for than its share of the snapshot's pools says.
POPULARITY = {"H100-80GB": 3.0, "A100-80GB": 2.5, "A100-40GB": 2.0, "H200-141GB": 1.5,
              "L4": 1.5, "A10G": 1.2, "T4": 1.2, "L40S": 1.0, "V100-16GB": 0.6,
              "A10": 0.6, "V100-32GB": 0.4, "P100": 0.3, "P4": 0.2}
EQUIVALENT = {"A100-40GB": ["A100-80GB"], "A100-80GB": ["H100-80GB"],
              "V100-16GB": ["V100-32GB"], "T4": ["L4"], "A10G": ["A10", "L4"]}
"""The policy's `gpus.equivalent`: a request for the key may also take these."""
SECOND_CHOICE = {"H100-80GB": ["H200-141GB", "A100-80GB"], "H200-141GB": ["H100-80GB"],
                 "A100-80GB": ["H100-80GB", "A100-40GB"], "A100-40GB": ["A100-80GB"],
                 "L4": ["T4", "A10G", "L40S"], "T4": ["L4", "A10G"], "A10G": ["L4", "A10"],
                 "L40S": ["A10G", "L4"], "V100-16GB": ["V100-32GB", "T4"], "A10": ["A10G"],
                 "V100-32GB": ["V100-16GB"]}
"""A model a request may name next to its first (10 % do)."""
TEAM_SHARE = 0.65
"""Share of the requests that belong to a team (spread evenly over the teams)."""


@dataclass(frozen=True, slots=True)
class _Row:
    cloud: str
    instance_type: str
    gpu: str
    known: bool
    gpus: int
    vcpus: int | None
    memory_gb: float | None
    region: str
    zone: str
    prices: tuple[tuple[Market, float], ...]


def _num(text: str) -> float | None:
    return float(text) if text.strip() else None


def _read(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _prices(od: float | None, spot: float | None) -> tuple[tuple[Market, float], ...]:
    return tuple((m, p) for m, p in ((Market.ON_DEMAND, od), (Market.SPOT, spot))
                 if p is not None and p > 0)


def _row(r: Mapping[str, str], *, instance_type: str | None = None,
         vcpus: int | None = None, prices: tuple[tuple[Market, float], ...] | None = None,
         ) -> _Row:
    gpu, known = canonical(r["gpu"])
    return _Row(
        cloud=r["cloud"], instance_type=instance_type or r["instance_type"], gpu=gpu,
        known=known, gpus=int(r["gpus"]),
        vcpus=vcpus if vcpus is not None else (int(r["vcpus"]) if r["vcpus"] else None),
        memory_gb=_num(r["memory_gib"]), region=r["region"],
        zone=r["zone"] or r["region"],
        prices=prices if prices is not None else _prices(
            _num(r["on_demand_usd_per_hour"]), _num(r["spot_usd_per_hour"])))


def snapshot_rows(data_dir: Path = DATA_DIR) -> list[_Row]:
    """Every priced (instance type, zone) of the snapshot, GCP's hosts and GPUs joined."""
    rows = [_row(r) for r in _read(data_dir / "gpu-prices-aws.csv")]
    rows += [_row(r) for r in _read(data_dir / "gpu-prices-azure.csv")]
    gcp = _read(data_dir / "gpu-prices-gcp.csv")
    accel = {(r["zone"], r["gpu"], r["gpus"]): r for r in gcp if not r["instance_type"]}
    for r in gcp:
        if r["instance_type"]:
            a = accel.get((r["zone"], r["gpu"], r["gpus"]))
            if a is None:
                continue
            od = [_num(x["on_demand_usd_per_hour"]) for x in (r, a)]
            spot = [_num(x["spot_usd_per_hour"]) for x in (r, a)]
            rows.append(_row(r, prices=_prices(
                None if None in od else sum(od),  # type: ignore[arg-type]
                None if None in spot else sum(spot))))  # type: ignore[arg-type]
        elif r["gpu"] in N1_GPUS:
            gpus = int(r["gpus"])
            vcpus = min(8 * gpus, 64)
            od_a, spot_a = _num(r["on_demand_usd_per_hour"]), _num(r["spot_usd_per_hour"])
            rows.append(_row(
                r, instance_type=f"n1-standard-{vcpus}+{r['gpu'].lower()}x{gpus}",
                vcpus=vcpus, prices=_prices(
                    None if od_a is None else od_a + vcpus * N1_VCPU_HOUR[Market.ON_DEMAND],
                    None if spot_a is None else spot_a + vcpus * N1_VCPU_HOUR[Market.SPOT])))
    return [r for r in rows if r.prices]


def _pick(rng: random.Random, weighted: Sequence[tuple[_T, float]]) -> _T:
    values = [v for v, _ in weighted]
    return rng.choices(values, weights=[w for _, w in weighted])[0]


def _capacity(rng: random.Random, gpus: int, scale: float) -> int | None:
    """Free instances: 10 % unknown, 10 % none, else small (mean about 12 GPUs' worth,
    at most 20 instances)."""
    u = rng.random()
    if u < 0.10:
        return None
    if u < 0.20:
        return 0
    mean = scale * max(1.0, 12.0 / gpus)
    return min(20, 1 + int(rng.expovariate(1.0 / mean)))


def _quota_group(cloud: str, region: str, instance_type: str, gpu: str,
                 market: Market) -> tuple[str, str]:
    """(group name as the cloud's adapter names it, units: "vcpus" or "gpus")."""
    if cloud == "aws":
        fam = "P" if instance_type.startswith("p") else "G"
        return f"aws:{region}:{fam}:{market.value}", "vcpus"
    if cloud == "gcp":
        return f"gcp:{region}:{gpu}:{market.value}", "gpus"
    if market is Market.SPOT:
        return f"azure:{region}:lowprioritycores", "vcpus"
    fam = instance_type.removeprefix("Standard_").split("_")[0].rstrip("0123456789rsa")
    return f"azure:{region}:{fam.lower()}", "vcpus"


def offers_from_snapshot(n_offers: int, seed: int, *, data_dir: Path = DATA_DIR,
                         capacity_scale: float = 1.0, observed_at: datetime = T0
                         ) -> list[Offer]:
    """`n_offers` pools (offers) from the snapshot; see the module docstring for what is
    real and what is drawn. `capacity_scale` multiplies the mean free capacity (lower:
    more contention). Deterministic for a given seed."""
    rng = random.Random(seed)
    rows = snapshot_rows(data_dir)
    base = [(row, market, price) for row in rows for market, price in row.prices]
    if n_offers <= len(base):
        picked = sorted(rng.sample(range(len(base)), n_offers))
        specs = [(*base[i], 0) for i in picked]
    else:
        specs = [(*b, 0) for b in base]
        copy = 1
        while len(specs) < n_offers:
            copy += 1
            take = min(len(base), n_offers - len(specs))
            chosen = base if take == len(base) else [base[i] for i in
                                                     sorted(rng.sample(range(len(base)), take))]
            specs += [(*b, copy) for b in chosen]
    offers: list[Offer] = []
    for row, market, price, copy in specs:
        zone = row.zone if copy == 0 else f"{row.zone}~{copy}"
        if copy:
            price *= 1 + rng.uniform(-PRICE_JITTER, PRICE_JITTER)
        spot = market is Market.SPOT
        avail: float | None = None
        if rng.random() < (0.8 if spot else 0.5):
            avail = round(rng.betavariate(5, 1.5) if spot else rng.betavariate(20, 1), 3)
        rate: float | None = None
        if spot and rng.random() < 0.85:
            rate = round(min(1.0, rng.lognormvariate(math.log(0.03), 0.9)), 4)
        offers.append(Offer(
            pool=PoolKey(row.cloud, row.region, zone, row.instance_type, market),
            gpu=row.gpu, gpus=row.gpus,
            gpu_memory_gb=None, vcpus=row.vcpus, memory_gb=row.memory_gb,
            price_per_hour=round(price, 5), observed_at=observed_at, availability=avail,
            capacity=_capacity(rng, row.gpus, capacity_scale), interruption_rate=rate,
            gpu_known=row.known))
    return _with_quotas(offers, rng)


def _with_quotas(offers: list[Offer], rng: random.Random) -> list[Offer]:
    """Quotas, drawn per group: shared by the group's pools, per pool, or unknown. A
    shared quota is 30–90 % of what the group's known free capacity would use."""
    groups: dict[str, list[int]] = defaultdict(list)
    units_of: dict[str, str] = {}
    for i, o in enumerate(offers):
        g, units = _quota_group(o.pool.cloud, o.pool.region, o.pool.instance_type, o.gpu,
                                o.pool.market)
        groups[g].append(i)
        units_of[g] = units
    out = list(offers)
    for g, members in groups.items():
        kind = rng.random()
        if kind < 0.35:
            continue  # unknown
        per_unit = [(offers[i].vcpus or 8) if units_of[g] == "vcpus" else offers[i].gpus
                    for i in members]
        if kind < 0.75:
            want = sum(u * (offers[i].capacity or 4) for i, u in zip(members, per_unit,
                                                                      strict=True))
            quota = max(max(per_unit), int(want * rng.uniform(0.3, 0.9)))
            for i, u in zip(members, per_unit, strict=True):
                o = offers[i]
                out[i] = replace(o, quota_headroom=quota // u * o.gpus, quota_group=g,
                                 quota_units=u)
        else:
            for i in members:
                o = offers[i]
                cap = o.capacity if o.capacity is not None else 4
                out[i] = replace(o, quota_headroom=o.gpus * int(cap * rng.uniform(0.2, 1.2)))
    return out


def group_quotas(offers: Iterable[Offer]) -> dict[str, int]:
    """Each shared quota's size in its units (vCPUs or GPUs), as drawn: the largest
    `quota_headroom // gpus * quota_units` of its pools."""
    out: dict[str, int] = {}
    for o in offers:
        if o.quota_group is not None and o.quota_units and o.quota_headroom is not None:
            q = o.quota_headroom // max(o.gpus, 1) * o.quota_units
            out[o.quota_group] = max(out.get(o.quota_group, 0), q)
    return out


def _expected_gpus() -> float:
    total = sum(w for _, w in COUNTS)
    return sum(n * w for n, w in COUNTS) / total


def _by_gpu(offers: Iterable[Offer]) -> dict[str, list[Offer]]:
    """Priced offers of known models, by model."""
    out: dict[str, list[Offer]] = defaultdict(list)
    for o in offers:
        if o.gpu_known and o.price_per_hour is not None and o.gpus > 0:
            out[o.gpu].append(o)
    return out


def _model_weights(by_gpu: Mapping[str, Sequence[Offer]]) -> dict[str, float]:
    return {g: POPULARITY.get(g, 0.2) * math.sqrt(len(os_)) for g, os_ in by_gpu.items()}


def demand_price_per_gpu(offers: Iterable[Offer]) -> float:
    """The median price per GPU-hour of each model, averaged with the weights requests
    pick models by: what an average requested GPU costs."""
    by_gpu = _by_gpu(offers)
    weights = _model_weights(by_gpu)
    total = 0.0
    for g, os_ in by_gpu.items():
        ppg = sorted(o.price_per_hour / o.gpus for o in os_)  # type: ignore[operator]
        total += weights[g] * ppg[len(ppg) // 2]
    return total / sum(weights.values()) if weights else 1.0


def teams_for(n_requests: int, offers: Sequence[Offer]) -> dict[str, Team]:
    """Four teams with limits scaled to a batch of `n_requests` (each team gets about
    TEAM_SHARE / 4 of them): `research` may hold 85 % of the GPUs it asks for and at
    most 15 % of them in one zone; `prod` has a budget of 40 % of what its requests
    would spend at the median price per GPU-hour (`demand_price_per_gpu`), a little
    less than their cheapest placements cost; `batch` is spot only with at most half its
    GPUs in one cloud; `infra` has no limits."""
    demand = n_requests * TEAM_SHARE / 4 * _expected_gpus()
    ppg = demand_price_per_gpu(offers)
    return {
        "research": Team(max_gpus=max(16, int(0.85 * demand)), max_zone_share=0.15,
                         spread_grace_gpus=8),
        "prod": Team(budget_per_hour=round(max(50.0, 0.4 * demand * ppg), 2)),
        "batch": Team(markets=["spot"], max_cloud_share=0.5, spread_grace_gpus=16),
        "infra": Team(),
    }


def policy_for(teams: Mapping[str, Team] | None = None, **scoring: float) -> Policy:
    """The bench's policy: the teams, `gpus.equivalent` (EQUIVALENT), and the default
    scoring unless `scoring` overrides some of it."""
    return Policy(teams=dict(teams or {}), gpus=Gpus(equivalent=EQUIVALENT),
                  scoring=Scoring(**scoring))


def requests_mix(n_requests: int, offers: Sequence[Offer], seed: int, *,
                 teams: Mapping[str, Team] | None = None,
                 schedulers: Sequence[str] = ("sched-a", "sched-b", "sched-c", "sched-d"),
                 ) -> list[PlaceRequest]:
    """`n_requests` requests, deterministic for a given seed:

    * GPU model: weighted by the square root of its pools in `offers` times its
      POPULARITY (H100 and A100 the most); 10 % name a second, similar model themselves
      (SECOND_CHOICE), and the policy's EQUIVALENT widens more.
    * GPUs: 1/2/4/8/16 with weights 40/25/18/12/5 (gang: one pool).
    * market: spot 30 %, on_demand 25 %, any 30 %, the policy's default 15 %.
    * 25 % have a price cap between the 15th and 60th percentile of that model's price
      per GPU-hour; 10 % name one or two clouds, 5 % three regions that offer the model.
    * duration: none, 1, 2, 4, 8, 24 or 72 hours (the horizon their cost counts for).
    * team: with probability TEAM_SHARE one of `teams` (None: `teams_for`), evenly.
    """
    rng = random.Random(seed * 7919 + 17)
    if teams is None:
        teams = teams_for(n_requests, offers)
    team_names = sorted(teams)
    by_gpu = _by_gpu(offers)
    models = sorted(by_gpu)
    model_weight = _model_weights(by_gpu)
    weights = [model_weight[g] for g in models]
    ppg = {g: sorted(p for o in os_ if (p := o.price_per_gpu_hour) is not None)
           for g, os_ in by_gpu.items()}
    clouds = sorted({o.pool.cloud for o in offers})
    out: list[PlaceRequest] = []
    for i in range(n_requests):
        gpu = rng.choices(models, weights=weights)[0]
        gpu_list = [gpu]
        others = [g for g in SECOND_CHOICE.get(gpu, ()) if g in by_gpu]
        if others and rng.random() < 0.10:
            gpu_list.append(rng.choice(others))
        cap = None
        if rng.random() < 0.25:
            prices = ppg[gpu]
            cap = round(prices[int(rng.uniform(0.15, 0.60) * (len(prices) - 1))], 4)
        req_clouds = None
        if rng.random() < 0.10:
            req_clouds = tuple(sorted(rng.sample(clouds, rng.choice((1, 2)))))
        regions = None
        if rng.random() < 0.05:
            have = sorted({o.pool.region for o in by_gpu[gpu]})
            regions = tuple(sorted(rng.sample(have, min(3, len(have)))))
        team = rng.choice(team_names) if team_names and rng.random() < TEAM_SHARE else None
        out.append(PlaceRequest(
            scheduler=schedulers[i % len(schedulers)], request_id=f"s{seed}-r{i:06d}",
            gpu=tuple(gpu_list), gpus=_pick(rng, COUNTS),
            market=_pick(rng, MARKETS),
            max_price_per_gpu_hour=cap, clouds=req_clouds, regions=regions, team=team,
            duration_hours=_pick(rng, DURATIONS),
            lease_seconds=6 * 3600))
    return out


def pool_from(offers: Iterable[Offer], *, now: datetime = T0,
              stale_after_seconds: float = 3600) -> ResourcePool:
    """A ResourcePool holding `offers`, one slice per (cloud, region) as the poller
    fills it, fresh at `now`."""
    pool = ResourcePool(stale_after_seconds=stale_after_seconds, clock=lambda: now)
    slices: dict[tuple[str, str], list[Offer]] = defaultdict(list)
    for o in offers:
        slices[(o.pool.cloud, o.pool.region)].append(o)
    for slice_id, members in slices.items():
        pool.replace(slice_id, members)
    return pool


@dataclass(frozen=True, slots=True)
class Instance:
    """One bench instance: what placement.solve needs, and how it was made."""

    offers: list[Offer]
    requests: list[PlaceRequest]
    teams: dict[str, Team]
    policy: Policy
    pool: ResourcePool
    seed: int
    now: datetime = T0

    def describe(self) -> str:
        o, r = self.offers, self.requests
        markets = Counter(x.pool.market.value for x in o)
        cap = [x.capacity for x in o]
        shared = sum(x.quota_group is not None for x in o)
        own = sum(x.quota_headroom is not None and x.quota_group is None for x in o)
        return (f"{len(o)} offers ({markets['spot']} spot, {markets['on_demand']} on-demand; "
                f"by cloud {dict(sorted(Counter(x.pool.cloud for x in o).items()))}; "
                f"capacity unknown {sum(c is None for c in cap)}, zero "
                f"{sum(c == 0 for c in cap)}; quota shared by a group {shared}, own {own})"
                f"; {len(r)} requests ({sum(x.gpus for x in r)} GPUs, "
                f"{sum(x.team is not None for x in r)} with a team, "
                f"{sum(x.max_price_per_gpu_hour is not None for x in r)} capped)")


def instance(n_requests: int, n_offers: int, seed: int, *, capacity_scale: float = 1.0,
             **scoring: float) -> Instance:
    offers = offers_from_snapshot(n_offers, seed, capacity_scale=capacity_scale)
    teams = teams_for(n_requests, offers)
    return Instance(offers=offers, requests=requests_mix(n_requests, offers, seed, teams=teams),
                    teams=teams, policy=policy_for(teams, **scoring), pool=pool_from(offers),
                    seed=seed)
