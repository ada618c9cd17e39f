"""`gpubroker history` as users run it: a real process reading a real state file, written
by the real recorder (and, at the end, by a running daemon)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from daemon_helpers import StartDaemon
from factories import Clock, offer

from broker.market.changes import SliceId
from broker.market.pool import ResourcePool
from broker.market.recorder import MarketRecorder
from broker.market.traces import TraceRow, format_t, read_trace
from broker.model import Offer, utcnow
from broker.state.store import StateStore

AWS: SliceId = ("sim", "aws:us-east-1")
GCP: SliceId = ("sim", "gcp:us-central1")


def gpubroker(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=60, check=False)


def jsonl(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines()]


A = offer("us-east-1a", price=10.0)  # H100 spot
B = offer("us-east-1b", market="on_demand", price=30.0, availability=None)
T4 = offer("us-east-1a", instance_type="g4dn.xlarge", gpu="T4", gpus=1, price=0.2)
G = offer("us-central1-a", cloud="gcp", region="us-central1", instance_type="a3-highgpu-8g")


@dataclass
class History:
    path: Path
    now: datetime  # the recording's "now": polls were 10 h, 3 h and 1 h before it

    def at(self, hours_ago: float) -> str:
        return format_t(self.now - timedelta(hours=hours_ago))


async def record(path: Path, clock: Clock, polls: Iterable[tuple[float, SliceId, list[Offer]]]
                 ) -> None:
    """Record `polls` ((seconds after the last, slice, offers)) with the real recorder."""
    store = StateStore(path)
    await store.open()
    pool = ResourcePool(stale_after_seconds=1e9, clock=clock)
    recorder = MarketRecorder(store, retention_days=14, clock=clock)
    pool.subscribe(recorder.observe)
    task = asyncio.create_task(recorder.run())
    try:
        for after, slice_id, offers in polls:
            clock.advance(after)
            pool.replace(slice_id, [replace(o, observed_at=clock()) for o in offers])
        async with asyncio.timeout(10):
            await recorder.flush()
    finally:
        task.cancel()
        await store.close()


@pytest.fixture
async def history(tmp_path: Path) -> History:
    now = utcnow().replace(microsecond=0)
    path = tmp_path / "state.db"
    await record(path, Clock(now - timedelta(hours=10)), [
        (0, AWS, [A, B, T4]),
        (0, GCP, [G]),
        (7 * 3600, AWS, [replace(A, price_per_hour=11.0), B]),  # T4 gone
        (2 * 3600, AWS, [replace(A, price_per_hour=12.0), B, T4]),  # T4 back
    ])
    return History(path, now)


def summary(r: subprocess.CompletedProcess[str]) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_exports_every_change_in_time_order(history: History) -> None:
    r = gpubroker("history", "--state", history.path)
    assert r.returncode == 0, r.stderr
    rows = jsonl(r.stdout)
    assert [(row["t"], row["zone"], row["instance_type"], row.get("price_per_hour"),
             row.get("gone", False)) for row in rows] == [
        (history.at(10), "us-east-1a", "p5.48xlarge", 10.0, False),
        (history.at(10), "us-east-1b", "p5.48xlarge", 30.0, False),
        (history.at(10), "us-east-1a", "g4dn.xlarge", 0.2, False),
        (history.at(10), "us-central1-a", "a3-highgpu-8g", 24.0, False),
        (history.at(3), "us-east-1a", "p5.48xlarge", 11.0, False),
        (history.at(3), "us-east-1a", "g4dn.xlarge", None, True),
        (history.at(1), "us-east-1a", "p5.48xlarge", 12.0, False),
        (history.at(1), "us-east-1a", "g4dn.xlarge", 0.2, False),
    ]
    assert list(rows[0]) == ["t", "cloud", "region", "zone", "instance_type", "market", "gpu",
                             "gpus", "price_per_hour", "availability", "capacity",
                             "interruption_rate", "quota_headroom"]
    assert rows[1]["availability"] is None and rows[1]["market"] == "on_demand"
    assert set(rows[5]) == {"t", "cloud", "region", "zone", "instance_type", "market", "gone"}
    assert summary(r) == (f"exported 8 changes of 4 pools from {history.at(10)} "
                          f"to {history.at(1)}")


def test_filters_select_pools(history: History) -> None:
    def pools(*args: str) -> set[tuple[str, str, str, str]]:
        r = gpubroker("history", "--state", history.path, *args)
        assert r.returncode == 0, r.stderr
        return {(x["cloud"], x["zone"], x["instance_type"], x["market"])
                for x in jsonl(r.stdout)}

    h100 = {("aws", "us-east-1a", "p5.48xlarge", "spot"),
            ("aws", "us-east-1b", "p5.48xlarge", "on_demand"),
            ("gcp", "us-central1-a", "a3-highgpu-8g", "spot")}
    t4 = ("aws", "us-east-1a", "g4dn.xlarge", "spot")
    assert pools("--gpu", "H100-80GB") == h100
    assert pools("--gpu", "T4") == {t4}  # gone rows too: the pool knows its GPU
    assert pools("--gpu", "T4", "H100-80GB") == pools("--gpu", "T4", "--gpu", "H100-80GB")
    assert pools("--cloud", "gcp") == {("gcp", "us-central1-a", "a3-highgpu-8g", "spot")}
    assert pools("--market", "on_demand") == {("aws", "us-east-1b", "p5.48xlarge",
                                               "on_demand")}
    assert pools("--cloud", "aws", "--market", "spot", "--gpu", "H100-80GB") == {
        ("aws", "us-east-1a", "p5.48xlarge", "spot")}
    assert pools("--cloud", "azure") == set()  # known, just not recorded


def test_since_opens_with_every_pools_state(history: History) -> None:
    r = gpubroker("history", "--state", history.path, "--since", "2h")
    assert r.returncode == 0, r.stderr
    rows = list(read_back(r.stdout, history.path.parent))
    start = rows[0].t
    assert abs(start - (history.now - timedelta(hours=2))) < timedelta(seconds=30)
    # The state at the start (T4 was gone then), then the changes after it.
    assert [(r.t == start, r.pool.instance_type, r.pool.zone, r.price_per_hour)
            for r in rows] == [
        (True, "p5.48xlarge", "us-east-1a", 11.0),
        (True, "p5.48xlarge", "us-east-1b", 30.0),
        (True, "a3-highgpu-8g", "us-central1-a", 24.0),
        (False, "p5.48xlarge", "us-east-1a", 12.0),
        (False, "g4dn.xlarge", "us-east-1a", 0.2),
    ]


def test_since_and_until_absolute(history: History) -> None:
    r = gpubroker("history", "--state", history.path, "--since", history.at(5),
                  "--until", history.at(1))  # until is exclusive
    assert r.returncode == 0, r.stderr
    rows = jsonl(r.stdout)
    assert [(x["t"], x["instance_type"], x.get("price_per_hour"), x.get("gone", False))
            for x in rows] == [
        (history.at(5), "p5.48xlarge", 10.0, False),
        (history.at(5), "p5.48xlarge", 30.0, False),
        (history.at(5), "g4dn.xlarge", 0.2, False),
        (history.at(5), "a3-highgpu-8g", 24.0, False),
        (history.at(3), "p5.48xlarge", 11.0, False),
        (history.at(3), "g4dn.xlarge", None, True),
    ]
    assert summary(r) == (f"exported 6 changes of 4 pools from {history.at(5)} "
                          f"to {history.at(3)}")
    r = gpubroker("history", "--state", history.path, "--until", "9h")
    assert len(jsonl(r.stdout)) == 4


def read_back(text: str, folder: Path, name: str = "trace.jsonl") -> list[TraceRow]:
    path = folder / name
    path.write_text(text)
    return list(read_trace(path))


def test_csv_and_jsonl_round_trip_through_read_trace(history: History, tmp_path: Path
                                                     ) -> None:
    r = gpubroker("history", "--state", history.path)
    expected = read_back(r.stdout, tmp_path)
    assert len(expected) == 8
    csv_out = tmp_path / "out.csv"
    r = gpubroker("history", "--state", history.path, "--output", csv_out)
    assert r.returncode == 0 and r.stdout == ""
    assert csv_out.read_text().startswith("t,cloud,region,zone,instance_type,market,gpu,")
    assert list(read_trace(csv_out)) == expected
    gz = tmp_path / "out.jsonl.gz"
    assert gpubroker("history", "--state", history.path, "--output", gz).returncode == 0
    assert list(read_trace(gz)) == expected
    r = gpubroker("history", "--state", history.path, "--format", "csv")
    assert read_back(r.stdout, tmp_path, "stdout.csv") == expected


def test_config_names_the_state_file(history: History, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"state": {"path": str(history.path)}}))
    r = gpubroker("history", "--config", config, "--cloud", "gcp")
    assert r.returncode == 0, r.stderr
    assert len(jsonl(r.stdout)) == 1


@pytest.mark.parametrize(("args", "message"), [
    (["--gpu", "A100-80G"], "gpubroker: --gpu: unknown GPU model 'A100-80G'; "
                            "did you mean 'A100-80GB'?"),
    (["--gpu", "H100-80GB", "h100"], "gpubroker: --gpu: unknown GPU model 'h100'"),
    (["--cloud", "awz"], "gpubroker: --cloud: unknown cloud 'awz'; did you mean 'aws'?"),
    (["--since", "yesterday"], "gpubroker: --since: cannot read 'yesterday': expected an "
                               "ISO-8601 time"),
    (["--until", "2026-13-01"], "gpubroker: --until: cannot read '2026-13-01'"),
    (["--since", "1h", "--until", "2h"], "gpubroker: --until must be later than --since"),
])
def test_bad_arguments_exit_2_with_one_line(history: History, args: list[str],
                                            message: str) -> None:
    r = gpubroker("history", "--state", history.path, *args)
    assert r.returncode == 2
    assert summary(r).startswith(message), r.stderr
    assert r.stdout == ""


def test_a_missing_or_foreign_state_file_exits_2(tmp_path: Path) -> None:
    r = gpubroker("history", "--state", tmp_path / "nope.db")
    assert r.returncode == 2
    assert summary(r) == f"gpubroker: no state file at {tmp_path / 'nope.db'}"
    junk = tmp_path / "junk.db"
    junk.write_text("not a database, just text" * 100)
    r = gpubroker("history", "--state", junk)
    assert r.returncode == 2
    assert summary(r).startswith(f"gpubroker: {junk}: cannot read the state file: ")


# --- end to end ----------------------------------------------------------------------------


async def run_history(*args: str | Path) -> tuple[int, str, str]:
    """The command as a child process, without blocking the daemon's event loop."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "broker.cli", "history", *map(str, args),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_a_running_daemons_history_exports_its_pools(start_daemon: StartDaemon,
                                                           tmp_path: Path) -> None:
    rd = await start_daemon(state=tmp_path / "daemon.db")
    recorder = rd.daemon.recorder
    assert recorder is not None
    for _ in range(2):
        await rd.daemon.poller.poll_all()
    async with asyncio.timeout(10):
        await recorder.flush()
    assert recorder.polls_recorded == 3 * len(rd.sim.regions())
    code, out, err = await run_history("--state", tmp_path / "daemon.db")
    assert code == 0, err
    rows = read_back(out, tmp_path)
    offered = {o.pool: o for o in rd.daemon.pool}
    assert {r.pool for r in rows} == set(offered)
    assert [r.t for r in rows] == sorted(r.t for r in rows)
    assert all(not r.gone for r in rows)  # the test daemon's sim withdraws nothing
    # Polls within one second keep only the last state of that second.
    assert 0 < len(offered) <= len(rows) <= 3 * len(offered)
    # Each pool's last row is what the pool holds now.
    last = {r.pool: r for r in rows}
    for key, o in offered.items():
        assert (last[key].gpu, last[key].gpus, last[key].price_per_hour,
                last[key].capacity, last[key].quota_headroom) == (
            o.gpu, o.gpus, o.price_per_hour, o.capacity, o.quota_headroom)
    assert f"of {len(offered)} pools" in err


async def test_a_reader_gone_early_ends_it_quietly(tmp_path: Path) -> None:
    """`gpubroker history | head -1`: exit 0, nothing on stderr. The rows' read
    transaction used to end after the database had closed, in the garbage collector:
    "Exception ignored ... Cannot operate on a closed database"."""
    path = tmp_path / "state.db"
    offers = [offer(f"us-east-1{z}", instance_type=f"p{i}.x") for z in "ab" for i in range(60)]
    await record(path, Clock(utcnow() - timedelta(hours=5)), [
        (600, AWS, [replace(o, price_per_hour=10.0 + k) for o in offers]) for k in range(8)])

    def head_1() -> tuple[bytes, int, bytes]:
        with subprocess.Popen([sys.executable, "-m", "broker.cli", "history", "--state",
                               str(path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) as proc:
            assert proc.stdout is not None and proc.stderr is not None
            first = proc.stdout.readline()
            # 960 rows of about 280 bytes: more than a pipe holds, so the command is
            # still writing when its reader goes.
            proc.stdout.close()
            err = proc.stderr.read()
            return first, proc.wait(timeout=60), err

    first, code, err = await asyncio.to_thread(head_1)
    assert json.loads(first)["cloud"] == "aws"
    assert code == 0
    assert err.decode() == ""
