"""A person's mistakes at the command line: one line naming the thing, exit 2 (1 for what
may work next time, 0 for a reader that closed the pipe), never a traceback. Real
processes, real files."""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from broker.cli.main import _parser

POLICY = Path(__file__).resolve().parents[2] / "deploy" / "policy.example.yaml"
SMALL_SIM = "clouds: {sim: {seed: 3, regions_per_cloud: 1, zones_per_region: 2}}\n"


def gpubroker(*args: str | Path, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=60, check=False, **kw)


def one_line(r: subprocess.CompletedProcess[str], code: int = 2) -> str:
    """The only line on stderr, of a command that failed with `code`."""
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("gpubroker"), lines[0]
    return lines[0]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "folder").mkdir()
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    (tmp_path / "small.yaml").write_text(SMALL_SIM)
    (tmp_path / "not-a-db").write_text("hello\n")
    (tmp_path / "empty.db").write_bytes(b"")
    return {"missing": tmp_path / "missing.yaml", "folder": tmp_path / "folder",
            "no-trace": tmp_path / "market.jsonl.gz",
            "bad": tmp_path / "bad.yaml", "small": tmp_path / "small.yaml",
            "not-a-db": tmp_path / "not-a-db", "db": tmp_path / "empty.db",
            "nowhere": tmp_path / "no" / "such" / "out.csv"}


# --- a closed pipe --------------------------------------------------------------------


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly() -> None:
    # `gpubroker offers --format json | head -1`: far more than a pipe holds, so the
    # command is still writing when the reader goes
    with subprocess.Popen([sys.executable, "-m", "broker.cli", "offers", "--format", "json"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p:
        assert p.stdout is not None and p.stderr is not None
        first = p.stdout.readline()
        p.stdout.close()
        err = p.stderr.read()
        assert p.wait(timeout=60) == 0, err
    assert json.loads(first)["cloud"] and err == b""


# --- files: missing, a folder, not YAML, not a state file, not writable -------------------


@pytest.mark.parametrize(("args", "thing"), [
    (["run", "--config", "{missing}"], "{missing}: cannot read: No such file or directory"),
    (["run", "--config", "{folder}"], "{folder}: cannot read: Is a directory"),
    (["offers", "--config", "{bad}"], "{bad}:2:1: invalid YAML"),
    (["policy", "check", "{missing}"], "{missing}: cannot read: No such file"),
    (["policy", "check", "{folder}"], "{folder}: cannot read: Is a directory"),
    (["policy", "check", "{bad}"], "{bad}:2:1: invalid YAML"),
    (["policy", "explain", "{folder}", "--request", "{{}}"], "{folder}: cannot read"),
    (["policy", "diff", str(POLICY), "{bad}"], "{bad}:2:1: invalid YAML"),
    (["history", "--state", "{folder}"], "no state file at {folder} (a directory)"),
    (["history", "--state", "{not-a-db}"], "{not-a-db}: cannot read the state file: file "
                                           "is not a database"),
    (["history", "--state", "{db}", "--output", "{folder}"], "--output: {folder} is a "
                                                              "directory"),
    (["history", "--state", "{db}", "--output", "{nowhere}"], "--output: {nowhere}: no "
                                                               "folder"),
    (["backtest", "--market", "{no-trace}", "--workload", "gen:5"], "{no-trace}: No such "
                                                                    "file"),
    (["backtest", "--market", "sim:1h", "--workload", "{folder}"], "{folder}: Is a "
                                                                   "directory"),
    (["backtest", "--market", "sim:1h", "--workload", "gen:5", "--policy", "{bad}"],
     "{bad}:2:1: invalid YAML"),
    (["backtest", "--market", "sim:1h", "--workload", "gen:5", "--chart", "{nowhere}"],
     "--chart: {nowhere}: no folder"),
    (["backtest", "--market", "sim:1h", "--workload", "gen:5", "--json-out", "{folder}"],
     "--json-out: {folder} is a directory"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_a_bad_file_is_one_line_naming_it(files: dict[str, Path], args: list[str],
                                          thing: str) -> None:
    names = {k: str(v) for k, v in files.items()}
    line = one_line(gpubroker(*(a.format(**names) for a in args)))
    assert thing.format(**names) in line


def test_a_state_file_the_daemon_cannot_open(files: dict[str, Path], tmp_path: Path) -> None:
    for state, why in ((files["folder"], "it is a directory"),
                       (files["not-a-db"], "file is not a database")):
        config = tmp_path / "run.yaml"
        config.write_text(f"state: {{path: '{state}'}}\nhttp: {{listen: null}}\n{SMALL_SIM}")
        line = one_line(gpubroker("run", "--config", config))
        assert line == f"gpubroker: {state}: state.path: cannot open the state file: {why}"
        config.write_text(f"state: {{path: '{state}'}}\n{SMALL_SIM}")
        line = one_line(gpubroker("policy", "diff", POLICY, POLICY, "--config", config))
        assert str(state) in line


def test_mqtt_credential_files_are_read_at_start(files: dict[str, Path],
                                                 tmp_path: Path) -> None:
    """Not an MQTT server that is away (waited out for ever): a mistake, told at once."""
    config = tmp_path / "run.yaml"
    base = f"state: {{path: '{tmp_path / 'state.db'}'}}\nhttp: {{listen: null}}\n{SMALL_SIM}"
    for mqtt, line in (
            (f"{{url: 'mqtt://127.0.0.1:1', username: u, password_file: '{files['missing']}'}}",
             f"{files['missing']}: mqtt.password_file: cannot read: No such file or directory"),
            (f"{{url: 'mqtts://127.0.0.1:1', ca_file: '{files['bad']}'}}",
             f"{files['bad']}: mqtt.ca_file: cannot read: not a PEM certificate file")):
        config.write_text(f"{base}mqtt: {mqtt}\n")
        assert one_line(gpubroker("run", "--config", config)) == f"gpubroker: {line}"


def test_the_database_password_file_is_read_at_start(files: dict[str, Path],
                                                     tmp_path: Path) -> None:
    """High availability: an unreadable state.password_file is a mistake (exit 2), not a
    database that is away (which a standby waits out)."""
    config = tmp_path / "run.yaml"
    config.write_text("state: {url: 'postgresql://gpubroker@127.0.0.1:1/gpubroker', "
                      f"password_file: '{files['missing']}'}}\nhttp: {{listen: null}}\n"
                      f"{SMALL_SIM}")
    r = gpubroker("run", "--config", config)
    assert r.returncode == 2
    assert one_line(r) == (f"gpubroker: {files['missing']}: state.password_file: cannot "
                           "read: No such file or directory")


# --- URLs and addresses --------------------------------------------------------------


@pytest.mark.parametrize(("yaml", "key"), [
    ("mqtt: {url: 'http://broker:1883'}", "mqtt.url: must look like mqtt://HOST[:PORT]"),
    ("mqtt: {url: 'mqtt://broker:99999'}", "mqtt.url: port must be a number"),
    (f"mqtt: {{url: 'mqtt://{'a' * 300}:1883'}}", "mqtt.url: the host is no host name"),
    ("mqtt: {url: 'mqtt://broker:1883/x'}", "mqtt.url: expected mqtt://HOST[:PORT]"),
    ("clouds: {aws: {regions: [us-east-1], endpoint: 'http://'}}", "clouds.aws.endpoint: "
                                                                    "must be an http://"),
    ("clouds: {aws: {regions: [us-east-1], interruption_queue_url: 'sqs/queue'}}",
     "clouds.aws.interruption_queue_url: must be an http:// or https:// URL"),
    ("http: {listen: 'localhost'}", "http.listen: must be HOST:PORT"),
])
def test_a_bad_url_in_the_config_is_one_line(tmp_path: Path, yaml: str, key: str) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(yaml + "\n")
    for command in ("run", "offers"):
        assert key in one_line(gpubroker(command, "--config", config))


def test_an_http_address_the_daemon_cannot_listen_on(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    base = f"state: {{path: '{tmp_path / 'state.db'}'}}\nmqtt: {{url: 'mqtt://127.0.0.1:1'}}\n"
    config.write_text(base + "http: {listen: 'no-such-host.invalid:9464'}\n" + SMALL_SIM)
    line = one_line(gpubroker("run", "--config", config))
    assert line.startswith("gpubroker: http.listen no-such-host.invalid:9464: ")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config.write_text(base + f"http: {{listen: '127.0.0.1:{port}'}}\n" + SMALL_SIM)
        line = one_line(gpubroker("run", "--config", config), code=1)  # may be free later
    assert line == f"gpubroker: http.listen 127.0.0.1:{port}: Address already in use"


# --- unknown names: the nearest one ---------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["offers", "--gpu", "H100"],
     "gpubroker: --gpu: unknown GPU model 'H100'; did you mean 'H100-80GB'?"),
    (["offers", "--gpu", "L4", "a100"],
     "gpubroker: --gpu: unknown GPU model 'a100'; did you mean 'A100-40GB' or 'A100-80GB'?"),
    (["offers", "--gpu", "nvidia-tesla-t4"],
     "gpubroker: --gpu: unknown GPU model 'nvidia-tesla-t4'; did you mean 'T4'?"),
    (["offers", "--gpu", "Quantum-9000"],
     "gpubroker: --gpu: unknown GPU model 'Quantum-9000'; known: A10, A100-40GB, "),
    (["offers", "--cloud", "oracle"],
     "gpubroker: --cloud: unknown cloud 'oracle'; known: alibaba, aws, azure, gcp"),
    (["offers", "--cloud", "gpc"], "gpubroker: --cloud: unknown cloud 'gpc'; did you mean "
                                   "'gcp'?"),
    (["offers", "--market", "on-demand"],
     "gpubroker offers: argument --market: invalid choice: 'on-demand' (choose from 'spot', "
     "'on_demand', 'reserved'); did you mean 'on_demand'? (gpubroker offers --help)"),
    (["offer"], "gpubroker: argument COMMAND: invalid choice: 'offer' "),
    (["policy", "explain", str(POLICY), "--request",
      '{"request_id":"x","gpu":"L4","gpus":1,"team":"eu"}'],
     "gpubroker: --request: team: unknown team 'eu'; did you mean 'eu-health'?"),
    (["policy", "explain", str(POLICY), "--request", '{"request_id":"x","gpu":"H100",'
                                                     '"gpus":8,"team":"research"}'],
     "gpubroker: --request: gpu: unknown GPU model 'H100'; did you mean 'H100-80GB'?"),
    (["policy", "explain", str(POLICY), "--request", '{"request_id":"x","gpu":"Quantum",'
                                                     '"gpus":8}'],
     "gpubroker: --request: gpu: unknown GPU model 'Quantum'; known: "),
    (["policy", "explain", str(POLICY), "--request",
      '{"request_id":"x","gpu":"L4","gpus":1,"clouds":["awz"]}'],
     "gpubroker: --request: clouds: unknown cloud 'awz'; did you mean 'aws'?"),
], ids=lambda v: " ".join(v[:3]) if isinstance(v, list) else "")
def test_an_unknown_name_gets_the_nearest(files: dict[str, Path], args: list[str],
                                          message: str) -> None:
    line = one_line(gpubroker(*args, *(["--config", files["small"]]
                                       if args[0] in ("offers", "policy") else [])))
    assert line.startswith(message), line
    if "GPU model" in message and "known: " in message:
        assert "PPU" in line  # the simulated Alibaba's own name for its model, offered now


def test_offers_take_several_models_and_clouds_either_way(files: dict[str, Path]) -> None:
    def rows(*args: str) -> list[dict[str, Any]]:
        r = gpubroker("offers", "--config", files["small"], "--format", "json", *args)
        assert r.returncode == 0, r.stderr
        return [json.loads(line) for line in r.stdout.splitlines()]

    def pools(offers: list[dict[str, Any]]) -> list[tuple[str, ...]]:
        return [(o["cloud"], o["zone"], o["instance_type"], o["market"]) for o in offers]

    together = rows("--gpu", "H100-80GB", "L4", "--cloud", "aws", "gcp")
    apart = rows("--gpu", "H100-80GB", "--gpu", "L4", "--cloud", "aws", "--cloud", "gcp")
    assert together and sorted(pools(together)) == sorted(pools(apart))
    assert {o["gpu"] for o in together} == {"H100-80GB", "L4"}
    assert {o["cloud"] for o in together} == {"aws", "gcp"}
    # a model the cloud offers under its own name (not canonical) is a name like any other
    ppu = rows("--gpu", "PPU")
    assert ppu and {o["gpu"] for o in ppu} == {"PPU"}


# --- policy check: every problem, in the order of the file ----------------------------


def test_policy_check_reports_every_problem_by_line(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\n"
                      "gpus:\n  allow: [A100-80G]\n"                      # 3: a name
                      "teams:\n  ml:\n    max_gpus: lots\n"               # 6: a type
                      "    clouds: [gpc]\n"                               # 7: a name
                      "rules:\n  - name: a\n    match: {team: mll}\n    deny: x\n"  # 10
                      "scoring:\n  restart_hours: -1\n")                  # 13: a range
    r = gpubroker("policy", "check", policy)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    where = re.findall(rf"(?m)^gpubroker: {re.escape(str(policy))}:(\d+):", r.stderr)
    assert len(lines) == 5 and [int(n) for n in where] == [3, 6, 7, 10, 13]
    assert "did you mean 'A100-80GB'?" in lines[0] and "valid integer" in lines[1]
    assert "did you mean 'gcp'?" in lines[2] and "did you mean 'ml'?" in lines[3]


# --- help ------------------------------------------------------------------------------

MINE = ["run", "offers", "policy check", "policy explain", "policy diff", "history",
        "backtest"]


def test_every_option_has_help() -> None:
    def sub(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
        [subs] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        found: argparse.ArgumentParser = subs.choices[name]
        return found

    missing = []
    for command in MINE:
        parser = _parser()
        for word in command.split():
            parser = sub(parser, word)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
                continue
            if not action.help:
                missing.append(f"{command} {action.option_strings or action.dest}")
    assert missing == []


def test_a_file_name_with_terminal_codes_is_shown_escaped_when_it_is_good(
        tmp_path: Path) -> None:
    """A good file is named on stdout: its terminal escape codes are shown, not run."""
    policy = tmp_path / "p\x1b[2Jolicy.yaml"
    policy.write_text("version: 1\n")
    r = gpubroker("policy", "check", policy)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\\x1b[2J" in r.stdout
