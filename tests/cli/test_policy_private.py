"""`gpubroker private check FILE`: a servers file validated before it is installed."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def test_a_good_file_is_summed_up_with_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    example = ROOT / "deploy/private.example.yaml"
    assert main(["private", "check", str(example)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{example}: ok: 2 sites, 3 groups, 17 servers\n" and err == ""


def test_every_problem_is_listed_by_line_and_key_with_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "servers.yaml"
    bad.write_text("""\
version: 1
sites:
  fra1: {zones: [hall-a]}
groups:
  - name: a100
    site: fra
    gpu: A100-80G
    gpus: 8
    servers: [gpu-a01]
    price_per_gpu_hour: 0
""")
    assert main(["private", "check", str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"gpubroker: {bad}:6:5: groups[0].site: unknown site 'fra'; did you mean 'fra1'?",
        f"gpubroker: {bad}:7:5: groups[0].gpu: unknown GPU model 'A100-80G'; did you mean "
        "'A100-80GB'?",
    ]


def test_a_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["private", "check", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err == \
        f"gpubroker: {tmp_path / 'nope.yaml'}: cannot read: No such file or directory\n"
