"""Hostile inputs to the trace reader (`backtest --market`), the workload reader
(`backtest --workload`), `history --since/--until` and the command line's `--mqtt` and
`--timeout` (#27 items 8 and 9), each given to the real command in its own process,
with its address space capped at 1 GiB: exit 2, one line on stderr naming the file and
line (or the option) and the bound, no traceback, within the test's timeout.

Before the fix a trace spanning 2023 to 2999 ran for minutes into a MemoryError; a time
at year 1 or 9999 with an offset, a line of nested brackets, a price of 0 or 10⁹ GPUs
ended in tracebacks (OverflowError, RecursionError, AssertionError), as did
`history --since 99999999999d` and an over-long `--mqtt` host; `--timeout -1` and `nan`
were taken; file names were echoed with their escape sequences."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

MEMORY_LIMIT = 1 << 30  # bytes of address space each command may map
TIMEOUT = 30.0  # seconds; every refusal here comes in about one


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def gpubroker(*args: str | Path, cwd: Path | None = None
              ) -> tuple[subprocess.CompletedProcess[str], float]:
    """The command in a process of its own, memory capped; and how long it took."""
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "broker.cli", *map(str, args)],
                         capture_output=True, text=True, timeout=TIMEOUT, check=False,
                         preexec_fn=_cap_memory, cwd=cwd)
    return out, time.monotonic() - started


def refused(out: subprocess.CompletedProcess[str]) -> str:
    """The one line of a usage error (exit 2), checked."""
    assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr, \
        out.stderr[-3000:]
    lines = out.stderr.splitlines()
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    assert len(lines) == 1, out.stderr[-3000:]
    assert "\x1b" not in lines[0]
    return lines[0]


def row(t: str = "2023-01-01T00:00:00Z", **kw: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"t": t, "cloud": "aws", "region": "us-east-1", "zone": "us-east-1a",
                         "instance_type": "p4d.24xlarge", "market": "spot",
                         "gpu": "A100-40GB", "gpus": 8, "price_per_hour": 10.0,
                         "availability": 0.9, "capacity": 3, "interruption_rate": 0.1,
                         "quota_headroom": None}
    d.update(kw)
    return d


def lines(*rows: dict[str, Any]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def spot_and_on_demand(**kw: Any) -> bytes:
    return lines(*(row(f"2023-01-01T0{h}:00:00Z", market=m, **kw)
                   for h in range(3) for m in ("spot", "on_demand")))


# name, file content, what the one line says (after `FILE: `)
TRACES: list[tuple[str, bytes, str]] = [
    ("span-to-2999.jsonl", lines(row(), row("2023-06-01T00:00:00Z"),
                                 row("2999-01-01T00:00:00Z")),
     "line 3: t: '2999-01-01T00:00:00Z' is outside 1970-01-01T00:00:00Z .. "
     "2100-01-01T00:00:00Z"),
    ("span-76-years.jsonl", lines(row(), row("2099-01-01T00:00:00Z")),
     "line 2: t 2099-01-01T00:00:00Z is more than 731 days after the first row "
     "(2023-01-01T00:00:00Z); a backtest replays at most 731 days (MAX_SPAN_DAYS)"),
    ("year-1.jsonl", lines(row("0001-01-01T00:00:00+01:00")), "line 1: t: "),
    ("year-9999.jsonl", lines(row("9999-12-31T23:59:59-01:00")), "line 1: t: "),
    ("brackets.jsonl", b"[" * 100_000 + b"\n",
     "line 1: the line is longer than 65,536 bytes (MAX_LINE_BYTES)"),
    ("deep.jsonl", b"[" * 5000 + b"]" * 5000 + b"\n",
     "line 1: nested deeper than 16 levels (MAX_JSON_DEPTH)"),
    ("huge-line.jsonl", b"x" * 20_000_000,
     "line 1: the line is longer than 65,536 bytes (MAX_LINE_BYTES)"),
    ("prices-0.jsonl", spot_and_on_demand(price_per_hour=0),
     "line 1: price_per_hour: a spot price must be > 0, got 0"),
    ("gpus-1e9.jsonl", spot_and_on_demand(gpus=10**9),
     "line 1: gpus: must be ≤ 4,096, got 1000000000"),
    ("empty.jsonl", b"", "the market trace has no rows"),
    ("latin1.jsonl", lines(row()) + b'{"cloud": "caf\xe9"}\n',
     "line 2: not UTF-8: byte 0xe9 at column 15"),
    ("nan.jsonl", lines(row(price_per_hour=float("nan"))),
     "line 1: price_per_hour: expected a number or null, got nan"),
    ("inf.jsonl", lines(row(capacity=float("inf"))),
     "line 1: capacity: expected a whole number or null, got inf"),
    ("negative.jsonl", lines(row(price_per_hour=-1)),
     "line 1: price_per_hour: must not be negative, got -1"),
    ("duplicate.jsonl", lines(row(), row(price_per_hour=3.0)),
     "line 2: the pool aws/us-east-1/us-east-1a p4d.24xlarge spot has a row at "
     "2023-01-01T00:00:00Z already (line 1)"),
    ("digits.jsonl", json.dumps(row())[:-1].encode() + b', "quota_headroom": '
     + b"9" * 5000 + b"}\n", "line 1: not JSON this reader takes: Exceeds the limit"),
    ("capacity.jsonl", lines(row(capacity=10**20)),
     "line 1: capacity: must be ≤ 1,000,000,000, got 100000000000000000000"),
    ("price-1e300.jsonl", lines(row(price_per_hour=1e300)),
     "line 1: price_per_hour: must be ≤ 1e+06"),
    ("rate.jsonl", lines(row(interruption_rate=1e9)),
     "line 1: interruption_rate: must be ≤ 3600"),
    ("bad.csv", b"t,cloud,region,zone,instance_type,market\n" + b"," * 5_000_000 + b"\n",
     "line 2: the line is longer than 65,536 bytes"),
    ("bad.csv.gz", b"", ""),  # made below: a gzip bomb of one endless line
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import gzip

    folder = tmp_path_factory.mktemp("hostile")
    for name, content, _ in TRACES:
        (folder / name).write_bytes(content)
    with gzip.open(folder / "bad.csv.gz", "wb", compresslevel=9) as z:
        z.write(b"t,cloud,region,zone,instance_type,market\n")
        for _ in range(4):  # 64 MiB of one line, 64 KiB compressed
            z.write(b"a" * (16 << 20))
    return folder


@pytest.mark.parametrize(("name", "says"), [(n, s) for n, _, s in TRACES],
                         ids=[n for n, _, _ in TRACES])
def test_a_hostile_trace_is_one_line_exit_2(corpus: Path, name: str, says: str) -> None:
    if name == "bad.csv.gz":
        says = "line 2: the line is longer than 65,536 bytes (MAX_LINE_BYTES)"
    out, took = gpubroker("backtest", "--market", corpus / name, "--workload", "gen:20")
    line = refused(out)
    assert line.startswith(f"gpubroker: {corpus / name}: {says}"), line
    assert took < TIMEOUT


def test_the_step_bound_is_told_with_the_step(corpus: Path) -> None:
    trace = corpus / "100-days.jsonl"
    trace.write_bytes(lines(row(), row("2023-04-11T00:00:00Z")))
    out, _ = gpubroker("backtest", "--market", trace, "--workload", "gen:20",
                       "--step-minutes", "0.1")
    assert refused(out).endswith(
        "line 2: t 2023-04-11T00:00:00Z is more than 14 days after the first row "
        "(2023-01-01T00:00:00Z); a backtest takes at most 200,000 steps (MAX_STEPS) of 0.1 "
        "minutes (--step-minutes)")
    out, _ = gpubroker("backtest", "--market", "sim:1000d", "--workload", "gen:20")
    assert refused(out) == ("gpubroker: --market 'sim:1000d': a backtest replays at most "
                            "731 days (MAX_SPAN_DAYS)")


def test_a_tiny_on_demand_price_per_gpu_generates_a_workload(corpus: Path) -> None:
    """4096 GPUs at $0.001 an hour: the price per GPU rounds to 0 at four digits, and a
    generated price cap of 0 failed the request's own validation (an assert)."""
    trace = corpus / "tiny.jsonl"
    trace.write_bytes(spot_and_on_demand(gpus=4096, price_per_hour=0.001))
    out, _ = gpubroker("backtest", "--market", trace, "--workload", "gen:40",
                       "--strategy", "gpubroker", "--format", "json")
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["workload"]["requests"] == 40


def workload(**kw: Any) -> bytes:
    line = {"at_hours": 0, "request": {"request_id": "a", "gpu": "A100-40GB", "gpus": 8,
                                       "duration_hours": 1}}
    line.update(kw)
    return (json.dumps(line) + "\n").encode()


WORKLOADS: list[tuple[str, bytes, str]] = [
    ("deep.jsonl", b"[" * 5000 + b"]" * 5000 + b"\n",
     ":1: nested deeper than 16 levels (MAX_JSON_DEPTH)"),
    ("huge.jsonl", b"x" * 20_000_000, ":1: the line is longer than 65,536 bytes"),
    ("latin1.jsonl", b'{"at_hours": 0, "scheduler": "caf\xe9"}\n',
     ":1: not UTF-8: byte 0xe9 at column 34"),
    ("year-1.jsonl", workload(at="0001-01-01T00:00:00+01:00").replace(b'"at_hours": 0, ', b""),
     ":1: at: '0001-01-01T00:00:00+01:00' is outside 1970-01-01T00:00:00Z .. "
     "2100-01-01T00:00:00Z"),
    ("nan.jsonl", workload(at_hours=float("nan")), ":1: at_hours: expected a number >= 0"),
    ("far.jsonl", workload(at_hours=1e300), ":1: at_hours: must be at most 17544"),
    ("startup.jsonl", workload(startup_minutes=1e300),
     ":1: startup_minutes: must be at most 1.05264e+06 (MAX_MINUTES)"),
    ("digits.jsonl", b'{"at_hours": ' + b"9" * 5000 + b"}\n",
     ":1: not JSON this reader takes: Exceeds the limit"),
    ("empty.jsonl", b"", ": no request arrives within the market's span"),
]


@pytest.mark.parametrize(("name", "says"), [(n, s) for n, _, s in WORKLOADS],
                         ids=[n for n, _, _ in WORKLOADS])
def test_a_hostile_workload_is_one_line_exit_2(tmp_path: Path, name: str, says: str) -> None:
    content = dict((n, c) for n, c, _ in WORKLOADS)[name]
    (tmp_path / name).write_bytes(content)
    trace = tmp_path / "market.jsonl"
    trace.write_bytes(spot_and_on_demand())
    out, took = gpubroker("backtest", "--market", trace, "--workload", tmp_path / name)
    assert refused(out).startswith(f"gpubroker: {tmp_path / name}{says}"), out.stderr
    assert took < TIMEOUT


CLI: list[tuple[list[str], str]] = [
    (["place", "--gpu", "T4", "--gpus", "1", "--mqtt", "a" * 70 + ".example.com"],
     "gpubroker: MQTT URL 'aaaa"),
    (["leases", "--mqtt", "mqtt://" + "a" * 70 + ".example.com:1883"],
     "the host is no host name (each dot-separated label 1 to 63 characters, IDNA)"),
    (["leases", "--mqtt", "a" * 300], "the host is no host name (at most 253 characters"),
    (["demo", "--mqtt", "a" * 70 + ".example.com:1883"], "the host is no host name"),
    (["leases", "--mqtt", "\x1b[31mx"], "gpubroker: MQTT URL '\\x1b[31mx': Invalid IPv6 URL"),
    (["leases", "--timeout", "-1"], "argument --timeout: must be > 0 and at most 86400 "
                                    "seconds (MAX_TIMEOUT_SECONDS), got '-1'"),
    (["leases", "--timeout", "nan"], "argument --timeout: must be > 0"),
    (["release", "L-1", "--timeout", "inf"], "argument --timeout: must be > 0"),
    (["place", "--gpu", "T4", "--gpus", "1", "--timeout", "x"],
     "argument --timeout: expected a number of seconds, got 'x'"),
    (["history", "--state", "{state}", "--since", "99999999999d"],
     "gpubroker: --since: cannot read '99999999999d': a duration back from now reaches at "
     "most"),
    (["history", "--state", "{state}", "--until", "0001-01-01T00:00:00+01:00"],
     "gpubroker: --until: cannot read '0001-01-01T00:00:00+01:00': expected a time from "
     "1970-01-01T00:00:00Z to before 2100-01-01T00:00:00Z"),
    (["history", "--state", "{state}", "--since", "9999-12-31T23:59:59-01:00"],
     "gpubroker: --since: cannot read"),
    (["backtest", "--market", "sim:1d", "--workload", "gen:5", "--seeds", "100000000"],
     "gpubroker: --seeds: must be at most 100 (MAX_SEEDS)"),
    (["backtest", "--market", "sim:1d", "--workload", "gen:5", "--step-minutes", "1e300"],
     "gpubroker: --step-minutes: must be at most 1440 (MAX_STEP_MINUTES)"),
    (["backtest", "--market", "sim:1d", "--workload", "gen:5", "--max-wait-hours", "inf"],
     "gpubroker: --max-wait-hours: must be at most 17544"),
    (["backtest", "--market", "sim:1d", "--workload", "gen:5", "--private-gpus",
      "1000000000", "--private-gpus-per-server", "1"],
     "gpubroker: --private-gpus: at most 100,000 servers (MAX_PRIVATE_SERVERS)"),
    (["backtest", "--market", "\x1b[2J\x9b.jsonl", "--workload", "gen:5"],
     "gpubroker: \\x1b[2J\\x9b.jsonl: No such file or directory"),
    (["backtest", "--market", "x.jsonl", "--workload", "w\x1b]0;title\x07.jsonl"],
     "gpubroker: w\\x1b]0;title\\x07.jsonl: No such file or directory"),
    (["history", "--state", "\x1b[2Jstate.db"], "gpubroker: no state file at \\x1b[2Jstate.db"),
]


@pytest.mark.parametrize(("args", "says"), CLI, ids=[" ".join(a)[:40] for a, _ in CLI])
def test_a_hostile_argument_is_one_line_exit_2(tmp_path: Path, args: list[str],
                                                says: str) -> None:
    state = tmp_path / "state.db"
    state.write_bytes(b"")
    if "x.jsonl" in args:  # the market is read before the workload
        (tmp_path / "x.jsonl").write_bytes(spot_and_on_demand())
    out, took = gpubroker(*(a.replace("{state}", str(state)) for a in args), cwd=tmp_path)
    assert says in refused(out), out.stderr
    assert took < TIMEOUT


def test_a_yaml_key_and_file_name_are_echoed_escaped(tmp_path: Path) -> None:
    """`policies.yamlsrc.Problem` escapes what it quotes (`broker.output.stdio.printable`)."""
    policy = tmp_path / "p\x1b[2J.yaml"
    policy.write_text('"\\e[31mred": 1\nversion: 1\n')
    out, _ = gpubroker("policy", "check", policy)
    assert refused(out) == (f"gpubroker: {tmp_path}/p\\x1b[2J.yaml:1:1: \\x1b[31mred: "
                            "unknown key")


def test_printable_escapes_controls_only() -> None:
    from broker.output.stdio import printable

    assert printable("a\x1b[31m\n\t\x7f\x9b\\x1b é ✓") == "a\\x1b[31m\\n\\t\\x7f\\x9b\\x1b é ✓"
    assert printable("x" * 300, 10) == "xxxxxxxxxx…(300 chars)"

