"""`gpubroker backtest --seeds N`: the runs over several seeds and their confidence
intervals."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
from pathlib import Path

import pytest

from broker.backtest import STRATEGIES
from broker.backtest.compare import t_interval
from broker.cli.main import main

SINGLE_SEED_KEYS = ["market", "workload", "settings", "interruptions_drawn_from", "policy",
                    "strategies"]


def in_process(capsys: pytest.CaptureFixture[str], *args: str
               ) -> subprocess.CompletedProcess[str]:
    code = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


def test_the_t_interval_as_worked_out_by_hand() -> None:
    # 1, 2, 3, 4: mean 2.5, s = √(5/3) = 1.290994; t(0.975, 3 d.f.) = 3.182446;
    # half-width 3.182446 × 1.290994 / √4 = 2.054260
    mean, half = t_interval([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5
    assert half == pytest.approx(2.054260, abs=1e-6)
    # two values: s / √2 = |a − b| / 2, so the half-width is t(0.975, 1) × 1 = 12.706205
    assert t_interval([1.0, 3.0]) == (2.0, pytest.approx(12.706205, abs=1e-6))
    # 90 %: t(0.95, 3) = 2.353363
    assert t_interval([1.0, 2.0, 3.0, 4.0], 0.90)[1] == pytest.approx(
        2.353363 * math.sqrt(5 / 3) / 2, abs=1e-6)
    assert t_interval([5.0]) == (5.0, None)
    assert t_interval([2.0, 2.0, 2.0]) == (2.0, 0.0)
    with pytest.raises(ValueError):
        t_interval([])


def test_two_seeds_report_per_seed_figures_and_their_summary(
        capsys: pytest.CaptureFixture[str]) -> None:
    out = in_process(capsys, "backtest", "--market", "sim:4h:3:1", "--workload", "gen:30",
                     "--seeds", "2", "--seed", "5", "--format", "json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["report_format"] == 3
    assert all(k in report for k in SINGLE_SEED_KEYS)
    # the market names its seed (3): fixed; the workload and the draws take 5 and 6
    assert [(s["market_seed"], s["workload_seed"], s["draw_seed"])
            for s in report["seeds"]] == [(3, 5, 5), (3, 6, 6)]
    assert report["settings"]["draw_seed"] == 5  # the top level is the first seed's
    summary = report["summary"]
    assert summary["seeds"] == 2 and summary["confidence"] == 0.95
    assert [s["strategy"] for s in summary["strategies"]] == list(STRATEGIES)
    for i, row in enumerate(summary["strategies"]):
        for name in ("cost_per_useful_gpu_hour", "interruptions_per_1000_gpu_hours",
                     "unplaced"):
            xs = [s["strategies"][i][name] for s in report["seeds"]]
            assert row[name]["n"] == 2
            assert row[name]["mean"] == pytest.approx(statistics.fmean(xs), abs=1e-6)
            # two values: the half-width is t(0.975, 1) × |a − b| / 2
            assert row[name]["half_width"] == pytest.approx(
                12.706205 * abs(xs[0] - xs[1]) / 2, abs=1e-5)
    for s in report["seeds"]:
        for f in s["strategies"]:
            assert f["unplaced"] == f["never_placed"] + f["abandoned"]
    table = in_process(capsys, "backtest", "--market", "sim:4h:3:1", "--workload",
                       "gen:30", "--seeds", "2", "--seed", "5")
    assert table.returncode == 0, table.stderr
    assert "2 seeds: market 3, workload 5..6, draws 5..6" in table.stdout
    assert table.stdout.count(" ± ") >= 3 * len(STRATEGIES)
    assert "3/5/5" in table.stdout and "3/6/6" in table.stdout
    assert "2 seeds × 4 strategies" in table.stderr


def test_one_seed_keeps_the_single_seed_report(capsys: pytest.CaptureFixture[str]) -> None:
    args = ("backtest", "--market", "sim:4h:3:1", "--workload", "gen:20", "--strategy",
            "cheapest_spot,gpubroker")
    out = in_process(capsys, *args, "--format", "json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert list(report) == ["report_format", *SINGLE_SEED_KEYS, "seeds", "summary"]
    assert report["summary"]["strategies"][0]["cost_per_useful_gpu_hour"]["half_width"] \
        is None
    assert report["summary"]["strategies"][0]["cost_per_useful_gpu_hour"]["mean"] == \
        report["strategies"][0]["cost_per_useful_gpu_hour"]
    table = in_process(capsys, *args)
    assert "STRATEGY" in table.stdout and "±" not in table.stdout
    assert "draw seed 7, market seed 3, workload seed 7" in table.stdout


def test_explicit_seeds_stay_fixed_and_bad_counts_are_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    out = in_process(capsys, "backtest", "--market", "sim:2h:1:1", "--workload", "gen:10",
                     "--strategy", "on_demand", "--seeds", "3", "--workload-seed", "9",
                     "--draw-seed", "4", "--format", "json")
    assert out.returncode == 0, out.stderr
    assert [(s["workload_seed"], s["draw_seed"]) for s in json.loads(out.stdout)["seeds"]] \
        == [(9, 4)] * 3
    bad = in_process(capsys, "backtest", "--market", "sim:2h", "--workload", "gen:5",
                     "--seeds", "0")
    assert bad.returncode == 2 and "--seeds: must be >= 1" in bad.stderr



def test_the_chart_over_seeds_is_drawn(capsys: pytest.CaptureFixture[str],
                                       tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    chart = tmp_path / "seeds.png"
    out = in_process(capsys, "backtest", "--market", "sim:2h:1:1", "--workload", "gen:10",
                     "--seeds", "2", "--format", "json", "--chart", str(chart))
    assert out.returncode == 0, out.stderr
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(out.stdout)["summary"]["seeds"] == 2
