"""A private pool in the backtest (`--private-gpus`): every strategy cloud only and with
the pool, on the same market, requests and draws; what the pool saved and how busy it
was, in the table and the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from broker.backtest import STRATEGIES
from broker.backtest import compare as cmp
from broker.backtest.draws import hazard_schedule
from broker.backtest.ledger import Settings
from broker.backtest.market import MarketTrace, from_rows, save_market
from broker.backtest.private import PrivateSite, with_private
from broker.backtest.workload import Arrival, Workload
from broker.cli.main import main
from broker.market.traces import TraceRow
from broker.model import Market, PlaceRequest, PoolKey
from policies.model import Policy

T0 = datetime(2026, 11, 30, tzinfo=UTC)
STEP = 600.0
SETTINGS = Settings(step_seconds=STEP, startup_minutes=0.0, checkpoint_minutes=30.0)
A100 = "A100-80GB"


def key(market: str, zone: str = "us-east-1a", instance_type: str = "p4de.24xlarge"
        ) -> PoolKey:
    return PoolKey("aws", "us-east-1", zone, instance_type, Market(market))


SPOT, OD = key("spot"), key("on_demand")


def row(pool: PoolKey, *, price: float, gpu: str = A100, gpus: int = 8,
        rate: float | None = 0.0, availability: float = 0.9, hours: float = 0.0
        ) -> TraceRow:
    return TraceRow(t=T0 + timedelta(hours=hours), pool=pool, gpu=gpu, gpus=gpus,
                    price_per_hour=price, availability=availability, capacity=100,
                    interruption_rate=rate if pool.market is Market.SPOT else None,
                    quota_headroom=None)


def market(rows: Sequence[TraceRow], hours: float) -> MarketTrace:
    return from_rows(sorted(rows, key=lambda r: r.t), source="test", step_seconds=STEP,
                     end=T0 + timedelta(hours=hours))


def job(at_hours: float, rid: str, *, gpus: int = 8, duration: float = 2.0,
        **kw: Any) -> Arrival:
    return Arrival(at_hours * 3600.0, PlaceRequest(scheduler="s1", request_id=rid,
                                                  gpu=(A100,), gpus=gpus,
                                                  duration_hours=duration, **kw))


def run(m: MarketTrace, arrivals: Sequence[Arrival], site: PrivateSite,
        settings: Settings = SETTINGS) -> cmp.Comparison:
    w = Workload("test", tuple(sorted(arrivals, key=lambda a: a.at)))
    return cmp.compare(m, w, STRATEGIES, Policy(), settings, private=site)


def by_strategy(c: cmp.Comparison) -> dict[str, dict[str, Any]]:
    return {m["strategy"]: m for m in c.private_metrics()}


def test_the_pool_is_taken_first_and_kept_full_when_demand_exceeds_it() -> None:
    # an 8-GPU, 2-hour job every 5 minutes for 12 hours: about 24 jobs running at once
    # against a pool of 2 servers; spot $1/GPU-h, never interrupted; on-demand $3
    m = market([row(SPOT, price=8.0), row(OD, price=24.0)], hours=12)
    site = PrivateSite(16, A100, 8, 0.0)
    c = run(m, [job(k / 12, f"j{k}") for k in range(144)], site)
    got = by_strategy(c)
    assert list(got) == list(STRATEGIES)
    for name, d in got.items():
        assert d["owned_gpu_hours"] == pytest.approx(16 * 12)
        # a server freed by a completion is taken by the next arrival (every 5 minutes)
        assert d["utilisation"] > 0.97, name
        assert d["busy_gpu_hours"] == pytest.approx(d["asked_gpu_hours"])  # 8-GPU jobs
        assert d["paid_on_pool"] == 0.0 and d["interruptions_on_pool"] == 0
        # each hour on the pool is an hour not paid on the cheapest cloud option
        per_gpu = 3.0 if name == "on_demand" else 1.0
        assert d["saved"] == pytest.approx(per_gpu * d["busy_gpu_hours"], rel=1e-9)
        cloud, hybrid = d["cloud_only"], d["hybrid"]
        assert hybrid["total_cost"] == pytest.approx(cloud["total_cost"] - d["saved"])
        assert cloud["useful_gpu_hours"] == pytest.approx(hybrid["useful_gpu_hours"])
        assert d["saved_per_useful_gpu_hour"] == pytest.approx(
            cloud["cost_per_useful_gpu_hour"] - hybrid["cost_per_useful_gpu_hour"])
        assert d["saved_per_useful_gpu_hour"] == pytest.approx(
            per_gpu * d["busy_gpu_hours"] / cloud["useful_gpu_hours"], rel=1e-5)


def test_a_small_job_holds_a_whole_server_and_pays_the_marginal_price() -> None:
    # a 1-GPU spot instance at $1/h; on-demand only as 8 GPUs at $24/h
    m = market([row(SPOT, price=8.0), row(OD, price=24.0),
                row(key("spot", instance_type="p4d.1x"), price=1.0, gpus=1)], hours=4)
    site = PrivateSite(8, A100, 8, 0.25)  # one server: $2 an hour for its 8 GPUs
    got = by_strategy(run(m, [job(0, "one", gpus=1, duration=3.0)], site))
    for name, d in got.items():
        # the cheapest-price strategies keep the 1-GPU job on the $1 spot instance;
        # on_demand ($24 on-demand) and price_capacity (availability first) take the
        # whole server for it, and pay for its 8 GPUs
        if name in ("on_demand", "price_capacity"):
            assert d["busy_gpu_hours"] == pytest.approx(8 * 3.0), name
            assert d["asked_gpu_hours"] == pytest.approx(1 * 3.0)
            assert d["paid_on_pool"] == pytest.approx(0.25 * 8 * 3.0)
        else:
            assert d["busy_gpu_hours"] == 0.0, name


def test_sliced_servers_let_small_jobs_share_one() -> None:
    """`slices`: a server of 8 GPUs leased a GPU at a time holds eight 1-GPU jobs."""
    m = market([row(SPOT, price=80.0), row(OD, price=240.0)], hours=4)
    site = PrivateSite(8, A100, 8, 0.0, slices=8)
    assert (site.offer(m.start).gpus, site.offer(m.start).capacity, site.owned_gpus) == \
        (1, 8, 8)
    got = by_strategy(run(m, [job(0, f"one{k}", gpus=1, duration=3.0) for k in range(8)],
                          site))
    d = got["gpubroker"]
    # All eight on the one server: held GPU-hours are the ones asked for.
    assert d["busy_gpu_hours"] == pytest.approx(8 * 3.0)
    assert d["asked_gpu_hours"] == pytest.approx(8 * 3.0)
    assert d["hybrid"]["total_cost"] == 0.0


def test_a_lease_on_the_pool_is_never_interrupted() -> None:
    # spot rows without a rate are drawn at the default rate, here 30 per hour: every
    # spot lease is hit within a step or two. Were the pool drawn (its offer has no rate
    # either), its leases would be too.
    m = market([row(SPOT, price=8.0, rate=None), row(OD, price=24.0)], hours=8)
    settings = Settings(step_seconds=STEP, startup_minutes=0.0, checkpoint_minutes=30.0,
                        default_interruption_rate=30.0)
    site = PrivateSite(16, A100, 8, 0.0)
    c = run(m, [job(k / 4, f"j{k}", duration=3.0, market="spot") for k in range(32)],
            site, settings)
    for r in c.results:
        if r.strategy != "on_demand":
            assert r.tally.interrupted > 5, r.strategy  # the cloud-only runs on spot
    for r, d in zip(c.hybrid, c.private_metrics(), strict=True):
        assert d["busy_gpu_hours"] > 0.9 * d["owned_gpu_hours"], r.strategy
        assert d["interruptions_on_pool"] == 0
        assert all(pool != site.key for _, _, pool in r.tally.losses)
    # the draws never name the pool, and the market with it draws as the one without
    plain = hazard_schedule(m, seed=7, step_seconds=STEP, default_rate=30.0)
    hybrid = hazard_schedule(with_private(m, site), seed=7, step_seconds=STEP,
                             default_rate=30.0)
    assert hybrid.pool_hits == plain.pool_hits and len(plain.pool_hits) > 10
    assert hybrid.rates == plain.rates and site.key not in hybrid.rates
    assert all(hybrid.lease_hit(site.key, k, j, 2) is None
               for k in range(48) for j in range(32))


def test_cloud_only_is_the_run_without_the_pool_on_the_same_requests() -> None:
    m = market([row(SPOT, price=8.0, rate=0.5), row(OD, price=24.0),
                row(key("spot", "us-east-1b"), price=9.0, rate=0.1, availability=0.7)],
               hours=10)
    arrivals = [job(k / 6, f"j{k}", gpus=(1, 8, 16)[k % 3]) for k in range(50)]
    w = Workload("test", tuple(arrivals))
    plain = cmp.compare(m, w, STRATEGIES, Policy(), SETTINGS)
    both = cmp.compare(m, w, STRATEGIES, Policy(), SETTINGS,
                       private=PrivateSite(24, A100, 8, 0.0))
    assert [r.metrics() for r in both.results] == [r.metrics() for r in plain.results]
    assert both.workload is w and both.to_json()["strategies"] == plain.to_json()["strategies"]
    for d in both.private_metrics():
        assert d["hybrid"]["requests"] == 50
        assert d["busy_gpu_hours"] > 0
    # without the option, the report has no `private` key
    assert "private" not in plain.to_json()


def test_with_private_adds_one_pool_for_the_whole_market() -> None:
    m = market([row(SPOT, price=8.0), row(OD, price=24.0, hours=1.0)], hours=3)
    site = PrivateSite(20, "H100-80GB", 8, 0.0)
    h = with_private(m, site)
    assert site.servers == 3 and site.owned_gpus == 24
    assert site.key == PoolKey("private", "onprem", "onprem", "H100-80GB-server",
                               Market.RESERVED)
    assert (h.rows, h.pools) == (m.rows + 1, m.pools + 1)
    added = [(s.at, o) for s in h.steps for _, ch in s.slices for k, o in ch
             if k == site.key]
    assert len(added) == 1 and added[0][0] == 0.0
    offer = added[0][1]
    assert offer is not None
    assert offer.capacity == 3 and offer.availability == 1.0
    assert offer.interruption_rate is None and offer.price_per_hour == 0.0
    assert [t.instances for t in offer.targets] == [1, 1, 1]
    assert len({t.id for t in offer.targets}) == 3 and offer.owned_gpus == 24


# --- the command -------------------------------------------------------------------------

def trace_file(tmp_path: Path) -> Path:
    rows = [row(SPOT, price=8.0, rate=0.2), row(OD, price=24.0),
            row(key("spot", instance_type="g6.xlarge"), price=0.5, gpu="L4", gpus=1,
                rate=0.1),
            row(key("on_demand", instance_type="g6.xlarge"), price=0.8, gpu="L4", gpus=1),
            # a last row one step before the end: the trace then spans 12 hours
            row(OD, price=24.0, hours=12 - STEP / 3600)]
    path = tmp_path / "m.jsonl"
    save_market(market(rows, hours=12), path)
    return path


def in_process(capsys: pytest.CaptureFixture[str], *args: str
               ) -> subprocess.CompletedProcess[str]:
    code = main(["backtest", *args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


def test_the_json_report_adds_the_pool_and_stdout_holds_only_it(tmp_path: Path) -> None:
    trace = trace_file(tmp_path)
    common = ["--market", str(trace), "--workload", "gen:80", "--seeds", "2"]
    done = subprocess.run([sys.executable, "-m", "broker.cli", "backtest", *common,
                           "--private-gpus", "16", "--private-price", "0.5",
                           "--format", "json"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # the whole of stdout is one JSON document
    assert done.stdout.startswith("{") and done.stdout.endswith("}\n")
    assert "simulated hours per second" in done.stderr
    p = report["private"]
    assert (p["gpus"], p["gpu"], p["gpus_per_server"], p["servers"]) == (16, A100, 8, 2)
    assert p["pool"]["market"] == "reserved" and p["pool"]["cloud"] == "private"
    assert p["owned_gpu_hours"] == pytest.approx(16 * 12)
    assert p["fixed_cost_counted"] is False
    assert p["fixed_cost_at_price"] == pytest.approx(16 * 12 * 0.5)
    assert [s["strategy"] for s in p["strategies"]] == list(STRATEGIES)
    for s in p["strategies"]:
        assert {"owned_gpu_hours", "busy_gpu_hours", "utilisation", "saved",
                "saved_per_useful_gpu_hour", "cloud_only", "hybrid"} <= s.keys()
        assert s["cloud_only"]["interruptions_per_1000_gpu_hours"] is not None
        assert s["hybrid"]["interruptions_per_1000_gpu_hours"] is not None
        assert 0 <= s["utilisation"] <= 1
    for seed in report["seeds"]:
        assert [s["strategy"] for s in seed["private"]] == list(STRATEGIES)
        assert {"saved", "utilisation"} <= seed["private"][0].keys()
    rows = report["summary"]["private"]["strategies"]
    assert rows[0]["utilisation"]["n"] == 2 and rows[0]["saved"]["half_width"] is not None

    # the same command without the pool: the same workload and the same cloud-only runs
    plain = subprocess.run([sys.executable, "-m", "broker.cli", "backtest", *common,
                            "--format", "json"],
                           capture_output=True, text=True, timeout=120, check=False)
    assert plain.returncode == 0, plain.stderr
    alone = json.loads(plain.stdout)
    assert "private" not in alone and "private" not in alone["summary"]
    for k in ("market", "workload", "settings", "strategies"):
        assert report[k] == alone[k], k
    assert [s["strategies"] for s in report["seeds"]] == \
        [s["strategies"] for s in alone["seeds"]]


def test_the_table_says_what_the_pool_saved_and_that_its_fixed_cost_is_not_counted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = trace_file(tmp_path)
    args = ["--market", str(trace), "--workload", "gen:60", "--private-gpus", "16",
            "--strategy", "gpubroker,cheapest_spot"]
    out = in_process(capsys, *args)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "private pool: 16 × A100-80GB as 2 servers of 8 GPUs" in text
    assert "+ private pool" in out.stdout and "UTIL" in out.stdout
    assert "fixed cost is not counted: it is paid either way" in text
    assert "For reference" not in text  # nothing to say at a marginal price of 0
    out = in_process(capsys, *args, "--private-price", "0.5")
    assert "For reference, the pool's 192 GPU-hours at $0.5/GPU-h: $96 over the run" in \
        " ".join(out.stdout.split())


@pytest.mark.parametrize(("args", "message"), [
    (["--private-gpus", "0"], "--private-gpus: must be >= 1, got 0"),
    (["--private-gpus", "8", "--private-gpu", "A100"],
     "--private-gpu: unknown GPU model 'A100'; did you mean 'A100-40GB' or 'A100-80GB'?"),
    (["--private-gpus", "8", "--private-gpus-per-server", "0"],
     "--private-gpus-per-server: must be >= 1, got 0"),
    (["--private-gpus", "8", "--private-slices", "3"],
     "--private-slices: must divide the 8 GPUs of a server, got 3"),
    (["--private-gpus", "8", "--private-price", "-1"],
     "--private-price: must be a number >= 0 (USD per GPU-hour), got -1.0"),
    (["--private-gpus", "8", "--private-price", "nan"], "--private-price: must be a number"),
    (["--private-price", "0.3"], "--private-price: needs --private-gpus N"),
])
def test_bad_private_options_exit_2_with_a_clear_message(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
        message: str) -> None:
    out = in_process(capsys, "--market", str(tmp_path / "never-read.jsonl"), "--workload",
                     "gen:5", *args)
    assert out.returncode == 2
    assert out.stdout == ""
    assert f"gpubroker: {message}" in out.stderr
