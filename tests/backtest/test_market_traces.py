"""The real traces in data/traces, and the permutation of a trace file's zone labels."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from broker.backtest import compare as cmp
from broker.backtest.ledger import Settings
from broker.backtest.market import load_market, read_market, relabel_zones, zone_permutation
from broker.backtest.workload import generate_workload
from broker.cli.main import main
from broker.market.traces import TraceRow, read_trace
from policies.model import Policy

TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"
AWS_9AZ = TRACES / "aws-v100-p3-9az-2023-02-15.csv.gz"
AWS_16 = TRACES / "aws-v100-p3-16node-3az-2023-08-27.csv.gz"
GCP = TRACES / "gcp-gpu-weekly-2025-02-27.csv.gz"
STEP = 600.0


def in_process(capsys: pytest.CaptureFixture[str], *args: str
               ) -> subprocess.CompletedProcess[str]:
    code = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


def series(rows: list[TraceRow]) -> dict[tuple[str, str, str], tuple[Any, ...]]:
    """Per zone label, everything its rows say but the label."""
    out: dict[tuple[str, str, str], list[Any]] = {}
    for r in rows:
        k = r.pool
        out.setdefault((k.cloud, k.region, k.zone), []).append(
            (r.t, k.instance_type, k.market, r.gpu, r.gpus, r.price_per_hour,
             r.availability, r.capacity, r.interruption_rate, r.gone))
    return {label: tuple(s) for label, s in out.items()}


@pytest.mark.parametrize("path", [AWS_9AZ, AWS_16, GCP], ids=lambda p: p.name[:9])
def test_relabelling_is_a_permutation_of_the_zones_series(path: Path) -> None:
    rows = list(read_trace(path))
    before, after = series(rows), series(relabel_zones(rows, seed=3))
    assert set(after) == set(before)  # the same labels, each region its zones
    assert Counter(before.values()) == Counter(after.values())  # the same series
    assert after != before
    assert [r.t for r in relabel_zones(rows, seed=3)] == [r.t for r in rows]


def test_relabelling_repeats_for_a_seed_and_differs_across_seeds() -> None:
    rows = list(read_trace(AWS_9AZ))
    labels = {(r.pool.cloud, r.pool.region, r.pool.zone) for r in rows}
    assert relabel_zones(rows, seed=5) == relabel_zones(rows, seed=5)
    assert zone_permutation(sorted(labels), seed=5) == \
        zone_permutation(sorted(labels, reverse=True), seed=5)
    perms = {tuple(sorted(zone_permutation(labels, seed=s).items())) for s in range(8)}
    assert len(perms) == 8
    # within a cloud only
    mixed = {("aws", "us-east-1", "us-east-1a"), ("aws", "us-east-1", "us-east-1b"),
             ("gcp", "us-central1", "us-central1-a")}
    for s in range(5):
        assert zone_permutation(mixed, seed=s)[("gcp", "us-central1", "us-central1-a")] \
            == ("gcp", "us-central1", "us-central1-a")


def test_a_file_market_is_relabelled_unless_asked_not_to() -> None:
    a = load_market(str(AWS_9AZ), seed=4, step_seconds=STEP)
    b = load_market(str(AWS_9AZ), seed=4, step_seconds=STEP)
    kept = load_market(str(AWS_9AZ), seed=4, step_seconds=STEP, keep_zone_labels=True)
    assert a == b and a.seed == 4 and a.zone_labels == "permuted"
    assert kept.seed is None and kept.zone_labels == "recorded"
    assert kept == read_market(AWS_9AZ, step_seconds=STEP)
    assert a.describe()["zone_labels"] == "permuted"
    assert (a.rows, a.pools, a.gpu_pools, a.on_demand_ppg) == \
        (kept.rows, kept.pools, kept.gpu_pools, kept.on_demand_ppg)
    sim = load_market("sim:2h:1:1", seed=4, step_seconds=STEP)
    assert sim.zone_labels == "generated"


def test_cheapest_spot_no_longer_always_takes_the_same_zone() -> None:
    # Every spot pool has the same price: cheapest_spot takes the first free pool by
    # key. Under the recorded labels that is us-east-1a whatever the market seed; with
    # the labels permuted, the zone behind the first label changes with it.
    kept = [cmp.compare(load_market(str(AWS_9AZ), seed=s, step_seconds=STEP,
                                    keep_zone_labels=True),
                        generate_workload(60, seed=1, market=read_market(
                            AWS_9AZ, step_seconds=STEP)),
                        ["cheapest_spot"], Policy(), Settings(seed=1)).to_json()
            for s in (1, 2)]
    assert kept[0]["strategies"] == kept[1]["strategies"]  # the market seed did nothing
    results = []
    for s in (1, 2, 3, 4):
        market = load_market(str(AWS_9AZ), seed=s, step_seconds=STEP)
        work = generate_workload(60, seed=1, market=market)
        m = cmp.compare(market, work, ["cheapest_spot"], Policy(),
                        Settings(seed=1)).results[0].metrics()
        results.append((m["cost_per_useful_gpu_hour"], m["interruptions"],
                        m["failovers"]))
    assert len(set(results)) > 1, results


@pytest.mark.parametrize("path", [AWS_9AZ, AWS_16, GCP], ids=lambda p: p.name[:9])
def test_each_vendored_trace_runs_with_a_generated_workload(
        path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = in_process(capsys, "backtest", "--market", str(path), "--workload", "gen:40",
                     "--strategy", "cheapest_spot,gpubroker", "--format", "json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["market"]["zone_labels"] == "permuted"
    assert report["settings"]["market_seed"] == 7
    for s in report["strategies"]:
        assert s["requests"] == 40 and s["useful_gpu_hours"] > 0
    models = read_market(path, step_seconds=STEP).gpu_pools
    work = generate_workload(200, seed=3, market=read_market(path, step_seconds=STEP))
    assert {g for a in work.arrivals for g in a.request.gpu} <= set(models)
