"""`gpubroker backtest` as a person runs it: a real process, real files."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from broker.backtest import STRATEGIES
from broker.cli.main import main


def gpubroker(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    """The command as a separate process (its own hash seed, imports, exit code)."""
    return subprocess.run([sys.executable, "-m", "broker.cli", *args], capture_output=True,
                          text=True, timeout=120, check=False, **kw)


def in_process(capsys: pytest.CaptureFixture[str], *args: str
               ) -> subprocess.CompletedProcess[str]:
    """The same command through `broker.cli.main.main`, in this process (faster)."""
    code = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


@pytest.mark.slow
def test_end_to_end_json_on_a_simulated_day(tmp_path: Path) -> None:
    chart = tmp_path / "out.png"
    out = gpubroker("backtest", "--market", "sim:1d", "--workload", "gen:50", "--format",
                    "json", "--chart", str(chart))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [s["strategy"] for s in report["strategies"]] == list(STRATEGIES)
    assert report["market"]["source"] == "sim:1d:7:3" and report["market"]["hours"] == 24
    assert report["workload"] == {"source": "gen:50:7", "requests": 50,
                                  "gpu_hours_asked": report["workload"]["gpu_hours_asked"],
                                  "left_out_after_market_end": 0}
    for s in report["strategies"]:
        assert s["requests"] == 50 and s["useful_gpu_hours"] > 0
        assert s["cost_per_useful_gpu_hour"] > 0
    od = report["strategies"][0]
    assert od["interruptions"] == 0 and od["spot_share"] == 0
    assert "simulated hours per second" in out.stderr
    # the chart is a real PNG of the size it was drawn at (9 in wide at 110 dpi; 5.6 in
    # high, plus 0.3 in and a legend line of 0.2 in per strategy)
    data = chart.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (990, 737)
    assert len(data) > 10_000


def test_the_same_seed_gives_a_byte_identical_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # two processes: a different hash seed each, so no set or dict order may leak in
    args = ["backtest", "--market", "sim:4h:3:1", "--workload", "gen:60:4", "--seed", "11"]
    reports = []
    for n in range(2):
        path = tmp_path / f"r{n}.json"
        out = gpubroker(*args, "--json-out", str(path))
        assert out.returncode == 0, out.stderr
        assert "STRATEGY" in out.stdout  # table on stdout, JSON in the file
        reports.append(path.read_bytes())
    assert reports[0] == reports[1]
    out = in_process(capsys, *args, "--format", "json")
    assert out.stdout.encode() == reports[0]
    other = in_process(capsys, *args[:-1], "12", "--format", "json")
    assert other.returncode == 0 and other.stdout.encode() != reports[0]


def test_a_saved_market_and_workload_replay_the_same(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    market, work = tmp_path / "m.csv.gz", tmp_path / "w.jsonl"
    first = in_process(capsys, "backtest", "--market", "sim:4h:5:1", "--workload", "gen:40",
                       "--save-market", str(market), "--save-workload", str(work),
                       "--format", "json", "--strategy", "cheapest_spot,gpubroker")
    assert first.returncode == 0, first.stderr
    again = in_process(capsys, "backtest", "--market", str(market), "--workload", str(work),
                      "--format", "json", "--strategy", "cheapest_spot,gpubroker")
    assert again.returncode == 0, again.stderr
    third = in_process(capsys, "backtest", "--market", str(market), "--workload", str(work),
                       "--format", "json", "--strategy", "cheapest_spot,gpubroker")
    a, b = json.loads(first.stdout), json.loads(again.stdout)
    # The file holds the observed rows only: its replay draws interruptions from the
    # observed rates, not from the simulated market's hidden truth, so its figures
    # differ from the generated market's; two replays of the file agree exactly.
    assert b == json.loads(third.stdout)
    assert b["market"]["rows"] == a["market"]["rows"]
    assert b["workload"]["gpu_hours_asked"] == a["workload"]["gpu_hours_asked"]
    assert [s["requests"] for s in a["strategies"]] == [s["requests"] for s in
                                                       b["strategies"]]
    assert len(work.read_text().splitlines()) == 40


def test_bad_inputs_exit_2_naming_file_and_line(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "m.jsonl"
    trace.write_text(
        '{"t": "2026-11-30T10:00:00Z", "cloud": "aws", "region": "us-east-1", "zone": '
        '"us-east-1a", "instance_type": "g6.xlarge", "market": "on_demand", "gpu": "L4", '
        '"gpus": 1, "price_per_hour": 0.8, "availability": 0.9, "capacity": 5, '
        '"interruption_rate": null, "quota_headroom": null}\n'
        '{"t": "2026-11-30T10:10:00Z", "cloud": "aws"}\n')
    out = in_process(capsys, "backtest", "--market", str(trace), "--workload", "gen:5")
    assert out.returncode == 2
    assert f"{trace}: line 2: region" in out.stderr

    trace.write_text(trace.read_text().splitlines()[0] + "\n")
    work = tmp_path / "w.jsonl"
    work.write_text('{"at_hours": 0, "request": {"request_id": "a", "gpu": "L4", "gpus": 1, '
                    '"duration_hours": 1}}\n'
                    '{"at_hours": 0, "request": {"request_id": "b", "gpu": "L4", '
                    '"gpus": 0, "duration_hours": 1}}\n')
    out = in_process(capsys, "backtest", "--market", str(trace), "--workload", str(work))
    assert out.returncode == 2
    assert out.stderr.strip() == (f"gpubroker: {work}:2: request.gpus: Input should be "
                                  "greater than or equal to 1")

    for args, message in (
            (["--market", "sim:7x", "--workload", "gen:5"], "sim:DURATION"),
            (["--market", "sim:1h", "--workload", "gen:x"], "gen:N[:SEED]"),
            (["--market", "sim:1h", "--workload", "gen:5", "--strategy", "yolo"],
             "unknown strategy 'yolo'"),
            (["--market", "sim:1h", "--workload", str(tmp_path / "none.jsonl")],
             "none.jsonl"),
    ):
        out = in_process(capsys, "backtest", *args)
        assert out.returncode == 2, args
        assert message in out.stderr, (args, out.stderr)


def test_a_policy_file_steers_gpubroker_and_bad_ones_name_the_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\ndefaults:\n  market: on_demand\n")
    out = in_process(capsys, "backtest", "--market", "sim:3h:2:1", "--workload", "gen:30",
                     "--policy", str(policy), "--strategy", "gpubroker", "--format", "json")
    assert out.returncode == 0, out.stderr
    [s] = json.loads(out.stdout)["strategies"]
    # requests that say nothing take the policy's default market: only the spot-only
    # ones run on spot
    assert 0 < s["spot_share"] < 0.5
    assert json.loads(out.stdout)["policy"] == str(policy)
    policy.write_text("version: 1\nscoring:\n  restart_hour: 2\n")
    out = in_process(capsys, "backtest", "--market", "sim:1h", "--workload", "gen:5",
                     "--policy", str(policy))
    assert out.returncode == 2
    assert f"{policy}:3:3: scoring.restart_hour: unknown key" in out.stderr


def test_market_workload_and_draw_seeds_are_independent(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def run(name: str, *seeds: str) -> tuple[dict[str, Any], bytes, bytes]:
        m, w = tmp_path / f"{name}.jsonl", tmp_path / f"{name}-w.jsonl"
        out = in_process(capsys, "backtest", "--market", "sim:4h",
                         "--workload", "gen:40", "--format", "json", "--strategy",
                         "cheapest_spot", "--save-market", str(m), "--save-workload",
                         str(w), *seeds)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout), m.read_bytes(), w.read_bytes()

    base = run("base", "--seed", "5")
    draws = run("draws", "--seed", "5", "--draw-seed", "6")
    work = run("work", "--seed", "5", "--workload-seed", "6")
    mkt = run("mkt", "--seed", "5", "--market-seed", "6")
    assert base[0]["settings"]["market_seed"] == base[0]["settings"]["workload_seed"] == \
        base[0]["settings"]["draw_seed"] == 5
    assert draws[0]["settings"]["draw_seed"] == 6 and draws[0]["settings"]["market_seed"] == 5
    # the draw seed changes the draws only
    assert draws[1] == base[1] and draws[2] == base[2]
    assert draws[0]["strategies"] != base[0]["strategies"]
    # the workload seed changes the workload only
    assert work[1] == base[1] and work[2] != base[2]
    assert work[0]["workload"]["source"] == "gen:40:6"
    # the market seed changes the market
    assert mkt[1] != base[1] and mkt[0]["market"]["source"] == "sim:4h:6:3"


def test_the_pool_wide_share_is_checked_and_reported(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    for bad in ("1.5", "-0.1", "nan"):
        out = in_process(capsys, "backtest", "--market", "sim:1h:3:1", "--workload", "gen:5",
                         "--pool-wide-share", bad)
        assert out.returncode == 2, bad
        assert "--pool-wide-share: must be within 0..1" in out.stderr, out.stderr
    reports = {}
    for share in ("0.25", "0.9"):
        out = in_process(capsys, "backtest", "--market", "sim:2h:3:1", "--workload",
                         "gen:40:3", "--pool-wide-share", share, "--format", "json")
        assert out.returncode == 0, out.stderr
        reports[share] = json.loads(out.stdout)
        assert reports[share]["settings"]["pool_wide_share"] == float(share)
        assert "hidden true hazard" in reports[share]["interruptions_drawn_from"]
    # the same market, requests and draws' seed; interruptions drawn otherwise
    assert reports["0.25"]["market"] == reports["0.9"]["market"]
