"""The backtest on tiny hand-made markets and workloads whose answers are known: the real
placement, lease book and failover code on a simulated clock."""

from __future__ import annotations

import io
import json
import math
import statistics
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from broker.backtest import chart as charts
from broker.backtest import compare as cmp
from broker.backtest.draws import HazardSchedule, hazard_schedule, hidden_factor, uniforms
from broker.backtest.engine import simulate
from broker.backtest.ledger import Settings, Tally
from broker.backtest.market import (
    MarketError,
    MarketTrace,
    from_rows,
    offer_of,
    parse_sim_spec,
    read_market,
    save_market,
)
from broker.backtest.report import write_table
from broker.backtest.strategies import (
    STRATEGIES,
    Oracle,
    Strategy,
    build,
    choose_price_capacity,
)
from broker.backtest.workload import (
    Arrival,
    Workload,
    WorkloadError,
    generate_workload,
    load_workload,
)
from broker.market.pool import ResourcePool
from broker.market.traces import TraceRow
from broker.model import Market, Offer, PlaceRequest, PoolKey
from broker.placement.optimizer import Ask, Decision
from policies.model import Policy, Scoring

T0 = datetime(2026, 11, 30, tzinfo=UTC)
STEP = 600.0


def key(zone: str = "us-east-1a", market: str = "on_demand",
        instance_type: str = "g6.xlarge") -> PoolKey:
    return PoolKey("aws", "us-east-1", zone, instance_type, Market(market))


# Many arguments: a trace row's fields, each a keyword with the usual value.
def row(hours: float, pool: PoolKey, *, price: float | None = 1.0, gpus: int = 1,  # noqa: PLR0913
        gpu: str = "L4", availability: float | None = 0.9, capacity: int | None = 10,
        rate: float | None = 0.0, gone: bool = False) -> TraceRow:
    t = T0 + timedelta(hours=hours)
    if gone:
        return TraceRow(t=t, pool=pool, gone=True)
    return TraceRow(t=t, pool=pool, gpu=gpu, gpus=gpus, price_per_hour=price,
                    availability=availability, capacity=capacity,
                    interruption_rate=rate if pool.market is Market.SPOT else None,
                    quota_headroom=None)


def market(rows: Sequence[TraceRow], hours: float) -> MarketTrace:
    return from_rows(sorted(rows, key=lambda r: r.t), source="test", step_seconds=STEP,
                     end=T0 + timedelta(hours=hours))


def job(at_hours: float, rid: str, *, gpus: int = 1, duration: float = 2.0,
        gpu: str = "L4", **kw: Any) -> Arrival:
    return Arrival(at_hours * 3600.0, PlaceRequest(scheduler="s1", request_id=rid, gpu=(gpu,),
                                                  gpus=gpus, duration_hours=duration, **kw))


def workload(*arrivals: Arrival) -> Workload:
    return Workload("test", tuple(sorted(arrivals, key=lambda a: a.at)))


def tallies(m: MarketTrace, w: Workload, names: Sequence[str] = STRATEGIES,
            policy: Policy | None = None, **kw: Any) -> dict[str, Tally]:
    # No start-up and 30-minute checkpoints unless a test says otherwise: the figures
    # below are then easy to work out by hand.
    settings = Settings(**{"step_seconds": STEP, "startup_minutes": 0.0,
                           "checkpoint_minutes": 30.0, **kw})
    policy = policy or Policy(scoring=Scoring(restart_hours=settings.restart_hours))
    schedule = hazard_schedule(m, seed=settings.seed, step_seconds=settings.step_seconds,
                               default_rate=settings.default_interruption_rate)
    strategies = [build(n, policy) for n in names]
    return {s.name: t for s, t in zip(strategies, simulate(m, w, strategies, schedule,
                                                           settings), strict=True)}


def metrics(m: MarketTrace, w: Workload, names: Sequence[str] = STRATEGIES,
            **kw: Any) -> dict[str, dict[str, Any]]:
    return {n: cmp.Result(n, "", t).metrics() for n, t in tallies(m, w, names, **kw).items()}


SPOT, OD = key("us-east-1a", "spot"), key("us-east-1a", "on_demand")


def test_a_spot_pool_with_a_huge_hazard_against_on_demand() -> None:
    m = market([row(0, SPOT, price=1.0, rate=100.0), row(0, OD, price=3.0)], hours=10)
    got = metrics(m, workload(job(0, "j1", duration=2.0)))
    # on-demand: never interrupted, pays the price for exactly the job's two hours
    od = got["on_demand"]
    assert od["interruptions"] == 0
    assert od["total_cost"] == pytest.approx(6.0)
    assert od["cost_per_useful_gpu_hour"] == pytest.approx(3.0)
    assert od["useful_gpu_hours"] == pytest.approx(2.0)
    # the spot-first baselines take the cheap spot pool, are interrupted within the first
    # step (losing all the work so far) and fail over to on-demand (never back)
    for name in ("cheapest_spot", "price_capacity"):
        d = got[name]
        assert d["interrupted"] == 1 and d["failovers_by_reason"] == {"interrupted": 1}
        assert d["useful_gpu_hours"] == pytest.approx(2.0)
        assert 6.0 < d["total_cost"] <= 6.0 + STEP / 3600 * 1.0
        assert d["lost_gpu_hours"] == pytest.approx(d["total_cost"] - 6.0)
    # gpubroker's expected cost (restart_hours × rate) keeps it off that pool
    assert got["gpubroker"]["interruptions"] == 0
    assert got["gpubroker"]["total_cost"] == pytest.approx(6.0)


def test_cost_integrates_the_price_as_it_changes() -> None:
    m = market([row(0, OD, price=1.0), row(1, OD, price=2.0), row(2, OD, price=4.0),
                row(2.25, OD, price=4.0, capacity=9)], hours=6)
    w = workload(job(0.5, "j1", duration=3.0, gpus=1))
    d = metrics(m, w, ["on_demand"])["on_demand"]
    # 0.5 h at $1, 1 h at $2, 1.5 h at $4
    assert d["total_cost"] == pytest.approx(0.5 * 1 + 1 * 2 + 1.5 * 4)
    assert d["useful_gpu_hours"] == pytest.approx(3.0)
    assert d["completed"] == 1 and d["mean_wait_hours"] == 0.0


def test_gpus_paid_for_but_not_asked_for_are_idle_not_useful() -> None:
    eight = key("us-east-1a", "on_demand", "g6.48xlarge")
    m = market([row(0, eight, price=8.0, gpus=8)], hours=4)
    d = metrics(m, workload(job(0, "j1", gpus=6, duration=1.0)), ["on_demand"])["on_demand"]
    assert d["total_cost"] == pytest.approx(8.0)
    assert d["useful_gpu_hours"] == pytest.approx(6.0)
    assert d["idle_gpu_hours"] == pytest.approx(2.0)
    assert d["paid_gpu_hours"] == pytest.approx(8.0)
    assert d["cost_per_useful_gpu_hour"] == pytest.approx(8.0 / 6.0)


def _hazard_market() -> tuple[MarketTrace, Workload]:
    rows = [row(0, SPOT, price=1.0, rate=3.0), row(0, OD, price=3.0)]
    rows += [row(h, SPOT, price=1.0 + 0.01 * h, rate=3.0) for h in range(1, 12)]
    arrivals = [job(0.37 * i, f"j{i}", duration=1.5) for i in range(24)]
    return market(rows, hours=12), workload(*arrivals)


def test_interruptions_are_the_same_draws_for_every_strategy_and_call_order() -> None:
    m, w = _hazard_market()
    alone = tallies(m, w, ["cheapest_spot"])["cheapest_spot"]
    both = tallies(m, w, ["cheapest_spot", "price_capacity"])
    reversed_ = tallies(m, w, ["price_capacity", "gpubroker", "cheapest_spot"])
    assert alone.interrupted > 3  # the test means something
    # one spot pool: both spot-first strategies hold the same pool at the same times, so
    # they must meet exactly the same interruptions, whoever runs first or alongside
    assert both["cheapest_spot"].losses == alone.losses
    assert both["price_capacity"].losses == alone.losses
    assert reversed_["cheapest_spot"].losses == alone.losses
    assert reversed_["cheapest_spot"].cost == alone.cost
    # and each is one of the market's own draws: a pool-wide one, which depends on
    # (seed, pool, step) only, or a lease's own, which depends on (seed, pool, step, job)
    schedule = hazard_schedule(m, seed=7, step_seconds=STEP, default_rate=0.05)
    pool_wide = set(schedule.pool_hits)
    for t, _, pool in alone.losses:
        k = math.floor(t / STEP)
        assert (t, pool) in pool_wide or any(
            schedule.lease_hit(pool, k, j, 1) == t for j in range(len(w.arrivals)))


def test_the_draws_are_a_stable_function_of_seed_pool_and_step() -> None:
    pool = PoolKey("aws", "us-east-1", "us-east-1a", "p5.48xlarge", Market.SPOT)
    forward = [uniforms(7, pool, k) for k in range(5)]
    backward = [uniforms(7, pool, k) for k in reversed(range(5))][::-1]
    assert forward == backward
    assert uniforms(7, pool, 3) == (0.465220128061799, 0.056290309153150093)
    assert uniforms(8, pool, 3) != uniforms(7, pool, 3)
    assert all(0 <= u < 1 and 0 <= v < 1 for u, v in forward)


def test_a_gone_pool_fails_the_lease_over() -> None:
    cheap, dear = key("us-east-1a"), key("us-east-1b")
    m = market([row(0, cheap, price=2.0), row(0, dear, price=3.0),
                row(1, cheap, gone=True)], hours=8)
    d = metrics(m, workload(job(0, "j1", duration=5.0)), ["on_demand"],
                checkpoint_minutes=40.0)["on_demand"]
    assert d["capacity_lost"] == 1 and d["failovers_by_reason"] == {"capacity_lost": 1}
    # 1 h on the cheap pool, checkpointed at 40 min: 20 min lost
    assert d["lost_gpu_hours"] == pytest.approx(1 / 3)
    # then the remaining 5 - 2/3 h of work on the dear one
    assert d["total_cost"] == pytest.approx(1 * 2.0 + (5 - 2 / 3) * 3.0)
    assert d["completed"] == 1 and d["useful_gpu_hours"] == pytest.approx(5.0)


def test_a_lease_with_nowhere_to_go_waits_and_is_placed_again() -> None:
    only = key("us-east-1a")
    m = market([row(0, only, price=2.0), row(1, only, gone=True), row(2, only, price=2.0)],
               hours=10)
    t = tallies(m, workload(job(0, "j1", duration=5.0)), ["on_demand"])["on_demand"]
    assert t.failovers_nowhere == 1 and t.capacity_lost == 1
    assert t.hours_without_placement == pytest.approx(1.0)
    assert t.completed == 1
    # 1 h, all of it kept (checkpoints every 30 min); 4 h more from 2 h on
    assert t.cost == pytest.approx(2.0 * (1 + 4))
    assert t.lost_gpu_hours == 0


def test_requests_never_placed_are_counted_by_their_last_rejection() -> None:
    m = market([row(0, OD, price=3.0)], hours=3)
    w = workload(job(0, "no-such-gpu", gpu="B200"),
                 job(0, "too-cheap", max_price_per_gpu_hour=1.0),
                 job(0.1, "fine", duration=1.0))
    d = metrics(m, w, ["on_demand", "gpubroker"], max_wait_hours=1.0)
    for name in ("on_demand", "gpubroker"):
        assert d[name]["never_placed"] == 2
        assert d[name]["never_placed_by_code"] == {"no_capacity": 1, "over_price_cap": 1}
        assert d[name]["placed"] == 1 and d[name]["completed"] == 1


def test_a_request_waits_for_capacity_and_its_wait_is_counted() -> None:
    m = market([row(0, OD, price=3.0, capacity=1)], hours=6)
    w = workload(job(0, "first", duration=1.0), job(0, "second", duration=1.0))
    d = metrics(m, w, ["on_demand"])["on_demand"]
    assert d["placed"] == 2 and d["completed"] == 2
    # the second is placed at the first step after the first one ends (1 h)
    assert d["mean_wait_hours"] == pytest.approx(0.5)


@pytest.mark.parametrize(("checkpoint", "useful"), [(0.0, 3.0), (24.0, 2.8),
                                                    (45.0, 2.75), (90.0, 2.0)])
def test_checkpoints_decide_the_work_a_move_loses(checkpoint: float, useful: float) -> None:
    # (the engine once lost min(work, restart_hours) per move; the work since the last
    # checkpoint is what a restarted job really loses)
    a, b = key("us-east-1a"), key("us-east-1b")
    m = market([row(0, a, price=1.0), row(0, b, price=2.0), row(1, a, gone=True)], hours=3)
    d = metrics(m, workload(job(0, "long", duration=10.0)), ["on_demand"],
                checkpoint_minutes=checkpoint)["on_demand"]
    # 1 h on a, then 2 h on b; the move loses the work since the last checkpoint on a
    assert d["useful_gpu_hours"] == pytest.approx(useful)
    assert d["lost_gpu_hours"] == pytest.approx(3.0 - useful)
    assert d["paid_gpu_hours"] == pytest.approx(d["useful_gpu_hours"] + d["lost_gpu_hours"]
                                                + d["idle_gpu_hours"])
    assert d["running_at_end"] == 1


def test_a_price_above_the_lease_cap_moves_it_without_an_interruption() -> None:
    a, b = key("us-east-1a"), key("us-east-1b")
    m = market([row(0, a, price=2.0), row(0, b, price=3.0), row(1, a, price=5.0)], hours=6)
    w = workload(job(0, "capped", duration=2.0, max_price_per_gpu_hour=4.0))
    d = metrics(m, w, ["on_demand"])["on_demand"]
    assert d["failovers_by_reason"] == {"price_above_cap": 1}
    assert d["interruptions"] == 0
    # 1 h on a (checkpointed: nothing lost), then the last hour on b
    assert d["total_cost"] == pytest.approx(1 * 2.0 + 1 * 3.0)


def test_reoptimize_min_saving_moves_running_leases_for_gpubroker_only() -> None:
    a, b = key("us-east-1a"), key("us-east-1b")
    m = market([row(0, a, price=3.0), row(1, b, price=1.0)], hours=6)
    policy = Policy.model_validate({"scoring": {"restart_hours": 0.5},
                                    "failover": {"reoptimize_min_saving": 0.3}})
    w = workload(job(0, "j1", duration=3.0))
    d = metrics(m, w, ["on_demand", "gpubroker"], policy=policy)
    # gpubroker moves at the first step after the cheaper pool appears, at a checkpoint
    assert d["gpubroker"]["failovers_by_reason"] == {"reoptimized": 1}
    assert d["gpubroker"]["interruptions"] == 0
    assert d["gpubroker"]["total_cost"] == pytest.approx(1 * 3.0 + 2 * 1.0)
    # the baselines keep the policy's triggers but do not re-optimise
    assert d["on_demand"]["failovers"] == 0
    assert d["on_demand"]["total_cost"] == pytest.approx(9.0)


def test_spot_only_requests_stay_on_spot_and_on_demand_takes_everything() -> None:
    m = market([row(0, SPOT, price=1.0, rate=0.0), row(0, OD, price=3.0)], hours=4)
    w = workload(job(0, "spot", market="spot"), job(0, "od", market="on_demand"),
                 job(0, "any"))
    got = tallies(m, w)
    assert got["on_demand"].spot_gpu_hours == 0 and got["on_demand"].completed == 3
    for name in ("cheapest_spot", "price_capacity", "gpubroker"):
        # spot: the spot-only and the any request; on-demand: the on-demand-only one
        assert got[name].spot_gpu_hours == pytest.approx(4.0), name
        assert got[name].paid_gpu_hours == pytest.approx(6.0), name


def test_price_capacity_prefers_availability_then_price() -> None:
    cheap_scarce = key("us-east-1a", "spot")
    dear_deep = key("us-east-1b", "spot")
    deep_cheaper = key("us-east-1c", "spot")
    pool = ResourcePool(stale_after_seconds=300, clock=lambda: T0)
    pool.replace(("aws", "us-east-1"), [_offer(cheap_scarce, 0.5, 0.35),
                                        _offer(dear_deep, 1.2, 0.93),
                                        _offer(deep_cheaper, 1.1, 0.97)])
    policy = Policy()
    asks = [Ask(PlaceRequest(scheduler="s", request_id="r", gpu=("L4",), gpus=1,
                             market="spot"))]
    [got] = choose_price_capacity(asks, pool, policy, now=T0)
    assert isinstance(got, Decision)
    # 0.93 and 0.97 are the same level (the top tenth of the best, 10); the cheaper wins
    assert got.placement.pool == deep_cheaper
    pool.hold(deep_cheaper, 10)  # full: the next of the top level
    [got] = choose_price_capacity(asks, pool, policy, now=T0)
    assert isinstance(got, Decision) and got.placement.pool == dear_deep


def test_price_capacity_ranks_availability_within_each_cloud_then_takes_the_cheapest() -> None:
    # Each cloud publishes availability on its own scale (Azure's top is 0.9): within a
    # cloud the most available pool, then price; across clouds the cheapest pick. Ranked
    # on one scale, AWS's 1.0 would beat Azure's top 0.9 whatever the price.
    aws_deep, aws_scarce = key("us-east-1a", "spot"), key("us-east-1b", "spot")
    az_deep = PoolKey("azure", "eastus", "eastus-1", "Standard_NC4as_T4_v3", Market.SPOT)
    az_scarce = PoolKey("azure", "eastus", "eastus-2", "Standard_NC4as_T4_v3", Market.SPOT)
    pool = ResourcePool(stale_after_seconds=300, clock=lambda: T0)
    pool.replace(("aws", "us-east-1"), [_offer(aws_deep, 2.0, 1.0),
                                        _offer(aws_scarce, 0.9, 0.5)])
    pool.replace(("azure", "eastus"), [_offer(az_deep, 1.5, 0.9),
                                       _offer(az_scarce, 0.8, 0.1)])
    asks = [Ask(PlaceRequest(scheduler="s", request_id="r", gpu=("L4",), gpus=1,
                             market="spot"))]
    [got] = choose_price_capacity(asks, pool, Policy(), now=T0)
    assert isinstance(got, Decision) and got.placement.pool == az_deep
    assert "within azure" in got.reason and "level 10/10" in got.reason
    pool.hold(az_deep, 10)  # full: Azure's best is now its scarce pool, still cheaper
    [got] = choose_price_capacity(asks, pool, Policy(), now=T0)
    assert isinstance(got, Decision) and got.placement.pool == az_scarce


def _offer(pool: PoolKey, price: float, availability: float) -> Offer:
    return offer_of(row(0, pool, price=price, availability=availability, rate=0.05))


def test_strategies_say_how_they_choose() -> None:
    for name in STRATEGIES:
        s = build(name, Policy())
        assert s.name == name and s.how
    with pytest.raises(ValueError, match="unknown strategy"):
        build("random", Policy())


# --- markets and workloads ------------------------------------------------------------------

def test_a_trace_file_becomes_steps_and_bad_rows_name_their_line(tmp_path: Path) -> None:
    good = tmp_path / "m.jsonl"
    rows = [row(0, OD, price=3.0), row(0, SPOT, price=1.0, rate=0.1), row(1, SPOT, gone=True)]
    good.write_text("".join(json.dumps(r.to_json()) + "\n" for r in rows))
    m = read_market(good, step_seconds=STEP)
    assert [s.at for s in m.steps] == [0.0, 3600.0]
    assert m.end == T0 + timedelta(hours=1, seconds=STEP)  # one step after the last row
    assert m.gpu_pools == {"L4": 2} and m.on_demand_ppg == {"L4": 3.0}
    bad = tmp_path / "bad.jsonl"
    lines = good.read_text().splitlines()
    lines[1] = lines[1].replace('"spot"', '"cheap"')
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(MarketError, match=r"bad\.jsonl: line 2: market"):
        read_market(bad, step_seconds=STEP)


def test_a_market_saves_and_reads_back_the_same(tmp_path: Path) -> None:
    m = market([row(0, OD, price=3.0), row(0, SPOT, price=1.0, rate=0.1),
                row(0.5, SPOT, price=1.1, rate=0.2), row(1, SPOT, gone=True)], hours=2)
    for name in ("m.jsonl", "m.csv.gz"):
        save_market(m, tmp_path / name)
        back = read_market(tmp_path / name, step_seconds=STEP)
        assert back.steps == m.steps
    with pytest.raises(MarketError, match="unknown trace format"):
        save_market(m, tmp_path / "m.txt")


def test_sim_specs() -> None:
    spec = parse_sim_spec("sim:7d", default_seed=3)
    assert spec is not None and (spec.seconds, spec.seed, spec.regions_per_cloud) == \
        (7 * 86400, 3, 3)
    spec = parse_sim_spec("sim:36h:42:2", default_seed=3)
    assert spec is not None and (spec.seconds, spec.seed, spec.regions_per_cloud) == \
        (36 * 3600, 42, 2)
    assert str(spec) == "sim:36h:42:2"
    assert parse_sim_spec("trace.jsonl", default_seed=3) is None
    for bad in ("sim:7", "sim:7w", "sim:0d", "sim:1d:x", "sim:1d:1:0"):
        with pytest.raises(MarketError, match="sim:"):
            parse_sim_spec(bad, default_seed=3)


def _write(tmp_path: Path, lines: Sequence[str]) -> Path:
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_workload_lines_are_read_in_time_order(tmp_path: Path) -> None:
    m = market([row(0, OD)], hours=10)
    req = {"request_id": "a", "gpu": "L4", "gpus": 1, "duration_hours": 1}
    path = _write(tmp_path, [
        json.dumps({"at": "2026-11-30T02:00:00Z", "scheduler": "s1", "request": req}),
        "",
        json.dumps({"at_hours": 1.5, "request": {**req, "request_id": "b"}}),
        json.dumps({"at_hours": 11, "request": {**req, "request_id": "late"}}),
    ])
    w = load_workload(path, market=m)
    assert [(a.at, a.request.request_id, a.request.scheduler, a.line) for a in w.arrivals] \
        == [(5400.0, "b", "backtest", 3), (7200.0, "a", "s1", 1)]
    assert w.outside == 1


def test_workload_errors_name_the_line_with_the_daemons_messages(tmp_path: Path) -> None:
    m = market([row(0, OD)], hours=10)
    req = {"request_id": "a", "gpu": "L4", "gpus": 1, "duration_hours": 1}
    path = _write(tmp_path, [
        json.dumps({"at_hours": 0, "request": req}),
        "{not json",
        json.dumps({"at_hours": 0, "request": {**req, "request_id": "b", "gpus": "eight"}}),
        json.dumps({"at_hours": 0, "request": {**req, "request_id": "c",
                                               "duration_hours": None}}),
        json.dumps({"at_hours": 0, "request": req}),
        json.dumps({"at": "2026-11-29T00:00:00Z", "request": {**req, "request_id": "d"}}),
        json.dumps({"request": {**req, "request_id": "e"}}),
        json.dumps({"at_hours": 1, "scheduler": "no spaces", "request": {**req,
                                                                         "request_id": "f"}}),
        json.dumps({"at_hours": 1, "request": {**req, "request_id": "g", "gang": False,
                                               "max_parts": 2}}),
    ])
    with pytest.raises(WorkloadError) as err:
        load_workload(path, market=m)
    problems = err.value.problems
    assert problems[0].startswith(f"{path}:2: not valid JSON")
    # the daemon's own validation message for the field
    assert problems[1] == f"{path}:3: request.gpus: Input should be a valid integer"
    assert problems[2].startswith(f"{path}:4: request.duration_hours: required")
    assert problems[3].startswith(f"{path}:5: request.request_id: 'a' of scheduler "
                                  "'backtest' is already on line 1")
    assert problems[4].startswith(f"{path}:6: at: '2026-11-29T00:00:00Z' is before the "
                                  "market starts")
    assert problems[5].startswith(f"{path}:7: needs exactly one of at")
    assert problems[7].startswith(f"{path}:9: request.max_parts: the backtest places every "
                                  "request whole")
    assert problems[6].startswith(f"{path}:8: scheduler:")
    assert len(problems) == 8


def test_generated_workloads_fit_the_market_and_repeat() -> None:
    big = key("us-east-1a", "on_demand", "p5.48xlarge")
    m = market([row(0, OD, price=0.8), row(0, SPOT, price=0.4, rate=0.1),
                row(0, big, gpu="H100-80GB", gpus=8, price=98.0)], hours=24)
    w = generate_workload(400, seed=5, market=m)
    assert w == generate_workload(400, seed=5, market=m)
    assert w != generate_workload(400, seed=6, market=m)
    reqs = [a.request for a in w.arrivals]
    assert {r.gpus for r in reqs} == {1, 2, 4, 8, 16}
    assert {g for r in reqs for g in r.gpu} <= {"L4", "H100-80GB"}
    # weighted to what the market offers: two L4 pools, one H100 pool
    l4 = sum(r.gpu[0] == "L4" for r in reqs)
    assert 0.5 < l4 / len(reqs) < 0.85
    assert {r.market for r in reqs} == {None, "spot", "on_demand"}
    assert 0 < sum(r.max_price_per_gpu_hour is not None for r in reqs) < len(reqs)
    assert all(0 <= a.at < 0.9 * m.seconds for a in w.arrivals)
    assert [a.at for a in w.arrivals] == sorted(a.at for a in w.arrivals)
    hours = sorted(r.duration_hours or 0 for r in reqs)
    assert 2 < hours[len(hours) // 2] < 4.5
    assert len({r.request_id for r in reqs}) == 400


def test_a_comparison_reports_table_and_json() -> None:
    m, w = _hazard_market()
    c = cmp.compare(m, w, STRATEGIES, Policy(scoring=Scoring(restart_hours=0.5)),
                    Settings(step_seconds=STEP))
    report = json.loads(c.dumps())
    assert [s["strategy"] for s in report["strategies"]] == list(STRATEGIES)
    assert report["market"]["hours"] == 12 and report["workload"]["requests"] == 24
    for s in report["strategies"]:
        assert math.isclose(s["cost_per_useful_gpu_hour"],
                            s["total_cost"] / s["useful_gpu_hours"], rel_tol=1e-5)
    assert "simulated hours per second" in c.speed_line()
    out = io.StringIO()
    write_table(c, out)
    text = out.getvalue()
    assert "$/USEFUL GPU-H" in text and all(n in text for n in STRATEGIES)


def test_the_chart_names_unplaced_requests_and_separates_coinciding_points(
        tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import dataclasses

    m, w = _hazard_market()
    c = cmp.compare(m, w, STRATEGIES, Policy(scoring=Scoring(restart_hours=0.5)),
                    Settings(step_seconds=STEP))
    twin = cmp.Result("gpubroker twin", "the same figures", c.results[-1].tally)
    c = dataclasses.replace(c, results=(*c.results, twin))
    points, unplotted = charts._points(c)
    assert [p.name for p in points] == [*STRATEGIES, "gpubroker twin"] and unplotted == []
    for p, r in zip(points, c.results, strict=True):
        d = r.metrics()
        assert f"{d['never_placed']} of {d['requests']} requests never placed" in p.legend
    assert len({p.style for p in points}) == len(points)  # a marker and colour each
    [shared] = [[p.name for p in g] for g in charts._coinciding(points)
                if any(p.name == "gpubroker twin" for p in g)]
    assert "gpubroker" in shared  # drawn inside one another, labelled together
    path = tmp_path / "chart.png"
    charts.write_chart(c, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_chart_over_seeds_puts_each_strategy_at_its_means_with_their_intervals(
        tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    m, w = _hazard_market()
    policy = Policy(scoring=Scoring(restart_hours=0.5))
    runs = tuple(cmp.compare(m, w, STRATEGIES, policy, Settings(step_seconds=STEP, seed=s))
                 for s in (1, 2, 3))
    seeds = cmp.Seeds(runs)
    points, unplotted = charts._seed_points(seeds)
    assert [p.name for p in points] == list(STRATEGIES) and unplotted == []
    for i, p in enumerate(points):
        figures = [c.results[i].metrics() for c in runs]
        x_mean, x_half = cmp.t_interval([f["interruptions_per_1000_gpu_hours"]
                                         for f in figures])
        y_mean, y_half = cmp.t_interval([f["cost_per_useful_gpu_hour"] for f in figures])
        assert (p.x, p.y) == pytest.approx((x_mean, y_mean), rel=1e-5)
        assert (p.xerr, p.yerr) == pytest.approx((x_half, y_half), rel=1e-4, abs=1e-6)
        assert "±" in p.legend and "unplaced on average" in p.legend
    assert any(p.xerr for p in points)  # the draws differ between seeds
    path = tmp_path / "seeds.png"
    charts.write_chart(seeds, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpubrokers_hazard_estimates_never_see_the_future() -> None:
    from broker.backtest.strategies import Gpubroker
    from broker.market.hazard import HazardEstimator

    class Probe(Gpubroker):
        """gpubroker, noting the estimate of SPOT its view holds at each placement."""

        def __init__(self, policy: Policy) -> None:
            super().__init__(policy)
            self.seen: list[tuple[datetime, Any]] = []

        def place(self, asks: Sequence[Ask], view: Any, now: datetime) -> Any:
            assert view.hazard is not None
            self.seen.append((now, view.hazard.estimate(SPOT)))
            return super().place(asks, view, now)

    def rows(turns_bad: bool) -> list[TraceRow]:
        out = [row(0, OD, price=3.0)]
        for n in range(6 * 20):
            hours = n / 6
            a = 0.7 + 0.1 * (n % 3)
            if turns_bad and hours >= 10:
                a = 0.2
            out.append(row(hours, SPOT, availability=a, rate=0.01 + 0.29 * (1 - a) ** 2))
        return out

    w = workload(*(job(h, f"j{h}", duration=0.5) for h in (1, 3.05, 5, 7.5, 9.95, 11, 15)))
    policy = Policy(scoring=Scoring(restart_hours=0.5, hazard_half_life_hours=6.0))
    settings = Settings(step_seconds=STEP)
    seen = {}
    for bad in (False, True):
        m = market(rows(bad), hours=20)
        probe = Probe(policy)
        simulate(m, w, [probe, build("cheapest_spot", policy)],
                 hazard_schedule(m, seed=7, step_seconds=STEP, default_rate=0.05), settings)
        seen[bad] = probe.seen
        # Each estimate is what the rows at or before its time give, and no more.
        for now, est in probe.seen:
            alone = HazardEstimator(half_life_hours=6.0)
            alone.observe_rows(r for r in rows(bad) if r.t <= now)
            alone.refresh()
            assert est == pytest.approx(alone.estimate(SPOT)), now
    before = T0 + timedelta(hours=10)
    early = [(t, e) for t, e in seen[False] if t < before]
    assert len(early) >= 5
    assert early == [(t, e) for t, e in seen[True] if t < before]
    late = dict(seen[False])
    assert any(e != late[t] for t, e in seen[True] if t >= before)


# --- hidden truth, per-instance draws, start-up and checkpoints, seeds ---------------------

def test_the_draws_follow_the_hidden_truth_not_the_observed_signal() -> None:
    import dataclasses

    calm, wild = key("us-east-1a", "spot"), key("us-east-1b", "spot")
    # both pools show the same signal all along; their hidden hazards differ tenfold
    rows = [row(0, calm, rate=0.1), row(0, wild, rate=0.1)]
    m = dataclasses.replace(market(rows, hours=500),
                            truth={calm: ([0.0], [0.02]), wild: ([0.0], [0.2])})
    schedule = hazard_schedule(m, seed=7, step_seconds=STEP, default_rate=0.05)
    assert schedule.hidden
    steps = int(500 * 3600 / STEP)
    hits = {p: sum(schedule.lease_hit(p, k, 0, 1) is not None for k in range(steps))
            + sum(1 for _, q in schedule.pool_hits if q == p) for p in (calm, wild)}
    # expected about 0.02 × 500 = 10 and 0.2 × 500 = 100 interruptions
    assert 3 <= hits[calm] <= 20 and 70 <= hits[wild] <= 130
    # the same market read from its rows has no truth: the observed rate times a hidden
    # per-pool factor is drawn, never the signal itself
    plain = hazard_schedule(market(rows, hours=500), seed=7, step_seconds=STEP,
                            default_rate=0.05)
    assert not plain.hidden and "hidden per-pool factor" in plain.truth
    for pool in (calm, wild):
        assert plain.rate(pool, 10) == pytest.approx(0.1 * hidden_factor(7, pool))
        assert plain.rate(pool, 10) != 0.1
    assert plain.rate(calm, 10) != plain.rate(wild, 10)
    blind = hazard_schedule(market([row(0, calm, rate=None)], hours=1), seed=7,
                            step_seconds=STEP, default_rate=0.05)
    assert blind.rate(calm, 0) == pytest.approx(0.05 * hidden_factor(7, calm))
    assert "hidden true hazard" in schedule.truth


def test_the_hidden_factor_is_lognormal_with_median_one_and_seeded() -> None:
    keys = [key(f"us-east-1{chr(97 + i % 26)}", "spot", f"t{i}") for i in range(4000)]
    factors = sorted(hidden_factor(7, k) for k in keys)
    logs = [math.log(f) for f in factors]
    assert 0.9 < factors[len(factors) // 2] < 1.1
    assert 0.45 < statistics.pstdev(logs) < 0.55  # HIDDEN_FACTOR_SIGMA
    assert hidden_factor(7, keys[0]) == hidden_factor(7, keys[0])
    assert sum(hidden_factor(8, k) != hidden_factor(7, k) for k in keys[:50]) == 50


def test_a_generated_market_hides_its_truth() -> None:
    from broker.backtest.market import SimSpec, simulate_market

    m = simulate_market(SimSpec(6 * 3600, 3, 1), step_seconds=STEP)
    assert m.truth is not None and m.seed == 3
    observed: dict[PoolKey, list[float | None]] = {}
    for step in m.steps:
        for _, changes in step.slices:
            for k, o in changes:
                if k.market is Market.SPOT and o is not None:
                    observed.setdefault(k, []).append(o.interruption_rate)
    assert set(m.truth) == set(observed)
    gcp = {r for k, rs in observed.items() if k.cloud == "gcp" for r in rs}
    assert len(gcp - {None}) > 10  # GCP's estimated uptime, read as a hazard
    # the rows never carry the hidden hazard: AWS and Azure show a few bands, Alibaba
    # a release rate to 0.1 %, GCP an uptime to 2 digits
    shown = {r for rs in observed.values() for r in rs}
    banded = {r for k, rs in observed.items() if k.cloud in ("aws", "azure") for r in rs}
    true = {r for _, rates in m.truth.values() for r in rates}
    assert len(banded - {None}) <= 10 < len(true) and not (true & (shown - {None}))


def test_the_oracle_places_by_the_true_hazard_the_others_cannot_see() -> None:
    # Two spot pools on two clouds with the same published rate, the riskier one
    # (by its hidden factor: the draws follow the rate times it) 0.5 % cheaper.
    # gpubroker sees the same risk and takes the cheaper; the oracle sees the truth and
    # takes the safer, and the report splits spot GPU-hours by cloud.
    aws = key("us-east-1a", "spot")
    gcp = PoolKey("gcp", "us-central1", "us-central1-a", "g2-standard-4", Market.SPOT)
    seed = 7
    safer, riskier = sorted((aws, gcp), key=lambda p: hidden_factor(seed, p))
    assert hidden_factor(seed, riskier) > 1.3 * hidden_factor(seed, safer)
    rows = [row(0, safer, price=1.0, rate=0.2, capacity=50),
            row(0, riskier, price=0.995, rate=0.2, capacity=50)]
    m = market(rows, hours=6)
    w = workload(*(job(0.25 * i, f"j{i}", duration=1.0) for i in range(16)))
    policy = Policy()
    settings = Settings(seed=seed, step_seconds=STEP, startup_minutes=0.0)

    def oracle(schedule: HazardSchedule, replay: MarketTrace) -> list[Strategy]:
        return [Oracle(policy, schedule, replay.start)]

    c = cmp.compare(m, w, ["gpubroker"], policy, settings, extra=oracle)
    got = {r.strategy: r.metrics() for r in c.results}
    assert list(got) == ["gpubroker", "oracle"]
    assert got["oracle"]["spot_share_by_cloud"][safer.cloud] > 0.8, got["oracle"]
    assert got["gpubroker"]["spot_share_by_cloud"][riskier.cloud] > 0.6, got
    assert sum(got["gpubroker"]["spot_share_by_cloud"].values()) == pytest.approx(1.0)
    assert "hidden per-pool factor" in c.to_json()["interruptions_drawn_from"]


def test_a_gang_is_interrupted_more_often_than_one_instance() -> None:
    pool = key("us-east-1a", "spot")
    rate = 0.02 / hidden_factor(7, pool)  # drawn at 0.02, the row's rate times the factor
    m = market([row(0, pool, rate=rate)], hours=1000)
    schedule = hazard_schedule(m, seed=7, step_seconds=STEP, default_rate=0.05)
    assert schedule.rate(pool, 0) == pytest.approx(0.02)
    steps = int(1000 * 3600 / STEP)
    one = sum(schedule.lease_hit(pool, k, 3, 1) is not None for k in range(steps))
    gang = sum(schedule.lease_hit(pool, k, 3, 16) is not None for k in range(steps))
    # per-instance part: 0.75 × 0.02 × n per hour over 1000 h: about 15 against 240
    assert 5 <= one <= 30 and 180 <= gang <= 300
    # a draw is a pure function of (seed, pool, step, job): asking again, or in another
    # order, gives the same; another job meets another draw
    assert [schedule.lease_hit(pool, k, 3, 16) for k in reversed(range(200))][::-1] == \
        [schedule.lease_hit(pool, k, 3, 16) for k in range(200)]
    other = [schedule.lease_hit(pool, k, 4, 16) for k in range(steps)]
    assert other != [schedule.lease_hit(pool, k, 3, 16) for k in range(steps)]


def test_gangs_meet_the_same_draws_under_every_strategy() -> None:
    rows = [row(0, SPOT, price=1.0, rate=0.4), row(0, OD, price=3.0)]
    rows += [row(h, SPOT, price=1.0 + 0.01 * h, rate=0.4) for h in range(1, 24)]
    arrivals = [job(0.5 * i, f"g{i}", gpus=4, duration=2.0) for i in range(30)]
    m, w = market(rows, hours=24), workload(*arrivals)
    alone = tallies(m, w, ["cheapest_spot"])["cheapest_spot"]
    together = tallies(m, w, ["gpubroker", "price_capacity", "cheapest_spot"])
    assert alone.interrupted > 5
    assert together["cheapest_spot"].losses == alone.losses
    assert together["price_capacity"].losses == alone.losses


def test_start_up_and_checkpoints_as_worked_out_by_hand() -> None:
    a, b = key("us-east-1a"), key("us-east-1b")
    m = market([row(0, a, price=1.0), row(0, b, price=2.0), row(1, a, gone=True)], hours=6)
    w = workload(job(0, "j", duration=2.0))
    d = metrics(m, w, ["on_demand"], startup_minutes=15.0,
                checkpoint_minutes=30.0)["on_demand"]
    # on a: 0.25 h start-up, 0.75 h of work, checkpointed at 0.5 h: 0.25 h lost;
    # on b: 0.25 h start-up again, then the remaining 1.5 h
    assert d["total_cost"] == pytest.approx(1 * 1.0 + (0.25 + 1.5) * 2.0)
    assert d["useful_gpu_hours"] == pytest.approx(2.0)
    assert d["lost_gpu_hours"] == pytest.approx(0.25 + 0.25 + 0.25)
    assert d["paid_gpu_hours"] == pytest.approx(2.75)
    t = tallies(m, w, ["on_demand"], startup_minutes=15.0)["on_demand"]
    assert t.startup_gpu_hours == pytest.approx(0.5)
    # a job's own line wins over the settings: no start-up, checkpoints every 15 min
    own = workload(Arrival(0.0, w.arrivals[0].request, 0, 0.0, 15.0))
    d = metrics(m, own, ["on_demand"], startup_minutes=15.0,
                checkpoint_minutes=30.0)["on_demand"]
    assert d["lost_gpu_hours"] == pytest.approx(0.0)
    assert d["total_cost"] == pytest.approx(1 * 1.0 + 1.0 * 2.0)


def test_workload_lines_may_name_start_up_and_checkpoints(tmp_path: Path) -> None:
    from broker.backtest.workload import save_workload

    m = market([row(0, OD)], hours=10)
    req = {"request_id": "a", "gpu": "L4", "gpus": 1, "duration_hours": 1}
    path = _write(tmp_path, [
        json.dumps({"at_hours": 0, "request": req, "startup_minutes": 20,
                    "checkpoint_minutes": 0}),
        json.dumps({"at_hours": 1, "request": {**req, "request_id": "b"}}),
    ])
    w = load_workload(path, market=m)
    assert [(a.startup_minutes, a.checkpoint_minutes) for a in w.arrivals] == \
        [(20.0, 0.0), (None, None)]
    save_workload(w, tmp_path / "again.jsonl", market=m)
    back = load_workload(tmp_path / "again.jsonl", market=m)
    assert [(a.startup_minutes, a.checkpoint_minutes) for a in back.arrivals] == \
        [(20.0, 0.0), (None, None)]
    bad = _write(tmp_path, [json.dumps({"at_hours": 0, "request": req,
                                        "startup_minutes": -1})])
    with pytest.raises(WorkloadError, match="startup_minutes: expected a number >= 0"):
        load_workload(bad, market=m)
