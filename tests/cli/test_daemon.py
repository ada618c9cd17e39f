"""The `gpubroker` command as SREs and ops teams run it: real processes, real signals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from mqtt_helpers import Mosquitto, ProbeFactory, payload_json

PREFIX = "gpubroker/v1"
OFFER_KEYS = ["cloud", "region", "zone", "instance_type", "market", "gpu", "gpus",
              "gpu_memory_gb", "vcpus", "memory_gb", "price_per_hour", "price_per_gpu_hour",
              "observed_at", "availability", "capacity", "interruption_rate", "quota_headroom"]


def gpubroker(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", *args], capture_output=True,
                          text=True, timeout=60, check=False, **kw)


def write_config(tmp_path: Path, mosquitto: Mosquitto | None = None, **extra: Any) -> Path:
    cfg: dict[str, Any] = {
        "site": "cli-test",
        "http": {"listen": None},
        "state": {"path": str(tmp_path / "state.db")},
        "poll": {"interval_seconds": 3600, "stale_after_seconds": 7200},
        "clouds": {"sim": {"seed": 3, "regions_per_cloud": 1, "zones_per_region": 2,
                           "preempt_rate_multiplier": 0}},
        **extra,
    }
    if mosquitto is not None:
        cfg["mqtt"] = {"url": mosquitto.url, "client_id": "gpubroker-cli-test"}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Proc:
    """The daemon as a child process, as systemd runs it."""

    def __init__(self, config: Path, log: Path) -> None:
        self.log = log
        self._log = log.open("ab")
        self.p = subprocess.Popen([sys.executable, "-m", "broker.cli", "run", "--config",
                                   str(config)], stdout=self._log, stderr=self._log)

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=10)
        self._log.close()


@pytest.fixture
def procs() -> Any:
    started: list[Proc] = []
    yield started
    for p in started:
        p.close()


async def wait_online(probe: Any, since: int) -> dict[str, Any]:
    msg = await probe.wait_for(lambda m: str(m.topic) == f"{PREFIX}/status" and m.payload
                               and payload_json(m)["state"] == "online", since=since,
                               timeout=20)
    return payload_json(msg)  # type: ignore[no-any-return]


async def place(probe: Any, request_id: str) -> dict[str, Any]:
    mark = probe.mark()
    await probe.publish(f"{PREFIX}/requests/s1/place",
                        {"request_id": request_id, "gpu": ["L4", "T4", "A10G"], "gpus": 1})
    msg = await probe.wait_for(
        lambda m: str(m.topic) == f"{PREFIX}/events/s1/placement.decided"
        and payload_json(m)["data"]["request_id"] == request_id, since=mark, timeout=10)
    return payload_json(msg)["data"]  # type: ignore[no-any-return]


async def test_sigkill_then_restart_keeps_leases(tmp_path: Path, mosquitto: Mosquitto,
                                                 probe_factory: ProbeFactory,
                                                 procs: list[Proc]) -> None:
    config = write_config(tmp_path, mosquitto)
    probe = await probe_factory([f"{PREFIX}/status", f"{PREFIX}/events/#"])
    first = Proc(config, tmp_path / "daemon.log")
    procs.append(first)
    boot1 = (await wait_online(probe, 0))["boot_id"]
    leases = [await place(probe, f"job-{i}") for i in range(3)]

    mark = probe.mark()
    first.p.send_signal(signal.SIGKILL)
    first.p.wait(timeout=10)
    will = await probe.wait_for(lambda m: str(m.topic) == f"{PREFIX}/status"
                                and payload_json(m)["state"] == "offline", since=mark)
    assert payload_json(will)["boot_id"] == boot1

    mark = probe.mark()
    second = Proc(config, tmp_path / "daemon.log")
    procs.append(second)
    online = await wait_online(probe, mark)
    assert online["boot_id"] != boot1
    # The leases survived: the same request_id answers with the same lease and placement.
    for i, before in enumerate(leases):
        after = await place(probe, f"job-{i}")
        assert after["lease_id"] == before["lease_id"]
        assert after["placement"] == before["placement"]
    # And their retained state is still there for late subscribers.
    late = await probe_factory([f"{PREFIX}/leases/s1/+"])
    seen = await late.wait_for_count(f"{PREFIX}/leases/s1/+", 3)
    assert {str(m.topic).rsplit("/", 1)[1] for m in seen} == {d["lease_id"] for d in leases}


async def test_sigterm_stops_cleanly_and_publishes_offline(
        tmp_path: Path, mosquitto: Mosquitto, probe_factory: ProbeFactory,
        procs: list[Proc]) -> None:
    config = write_config(tmp_path, mosquitto)
    probe = await probe_factory([f"{PREFIX}/status", f"{PREFIX}/events/#"])
    proc = Proc(config, tmp_path / "daemon.log")
    procs.append(proc)
    await wait_online(probe, 0)
    # `online` comes when MQTT connects; `ready` only after the first poll. A placement
    # answered proves the first poll is done, so the daemon has been ready.
    await place(probe, "job-before-stop")
    mark = probe.mark()
    proc.p.send_signal(signal.SIGTERM)
    assert proc.p.wait(timeout=20) == 0
    offline = await probe.wait_for(f"{PREFIX}/status", since=mark)
    assert payload_json(offline)["state"] == "offline"
    logs = [json.loads(line) for line in proc.log.read_text().splitlines() if line.strip()]
    assert {"starting", "ready", "shutting down", "stopped"} <= {e["event"] for e in logs}


def test_bad_config_exits_2_naming_each_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("site: lab\nmqtt:\n  url: http://x\npoll:\n  interval_secs: 5\n"
                    "clouds:\n  aws: {anonymous: true}\n")
    r = gpubroker("run", "--config", str(path))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert any(f"{path}:3:3: mqtt.url:" in ln for ln in lines), r.stderr
    assert any(f"{path}:5:3: poll.interval_secs: unknown key" in ln for ln in lines), r.stderr
    assert len(lines) >= 2


def test_missing_config_file_exits_2(tmp_path: Path) -> None:
    r = gpubroker("run", "--config", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2
    assert "cannot read" in r.stderr


def test_offers_json_has_exactly_the_spec_keys_sorted_by_price(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    r = gpubroker("offers", "--config", str(config), "--format", "json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) > 50
    assert all(list(row) == OFFER_KEYS for row in rows)
    prices = [row["price_per_gpu_hour"] for row in rows if row["price_per_gpu_hour"] is not None]
    assert prices == sorted(prices)
    assert {row["market"] for row in rows} == {"spot", "on_demand"}


def test_offers_filters_and_table(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    r = gpubroker("offers", "--config", str(config), "--gpu", "H100-80GB", "--cloud", "gcp",
                  "--market", "spot", "--format", "json")
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert rows and all(row["gpu"] == "H100-80GB" and row["cloud"] == "gcp"
                        and row["market"] == "spot" for row in rows)
    table = gpubroker("offers", "--config", str(config), "--gpu", "T4")
    assert table.returncode == 0
    header, *body, footer = table.stdout.splitlines()
    assert header.split()[:3] == ["CLOUD", "REGION", "ZONE"]
    assert footer == f"{len(body)} offers" and body


def test_policy_check(tmp_path: Path) -> None:
    good = tmp_path / "policy.yaml"
    good.write_text("version: 1\ndefaults:\n  market: spot\n  lease_seconds: 600\n")
    r = gpubroker("policy", "check", str(good))
    assert r.returncode == 0 and "ok" in r.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ndefaults:\n  market: cheapest\n")
    r = gpubroker("policy", "check", str(bad))
    assert r.returncode == 2
    assert f"{bad}:3:3: defaults.market:" in r.stderr


def test_usage_error_exits_2() -> None:
    r = gpubroker("offers", "--market", "preemptible")
    assert r.returncode == 2


def test_runs_without_any_cloud_sdk_installed(tmp_path: Path) -> None:
    """The daemon's modules import no cloud SDK unless that cloud is configured."""
    code = ("import sys, broker.daemon.assembly, broker.cli.main, adapters.sim; "
            "print(sorted(m for m in ('boto3','google.cloud','azure','alibabacloud_ecs20140526')"
            " if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, env={**os.environ})
    assert r.stdout.strip() == "[]"


def test_example_config_and_policy_are_valid() -> None:
    root = Path(__file__).resolve().parents[2]
    assert gpubroker("policy", "check", str(root / "deploy/policy.example.yaml")).returncode == 0
    from broker.daemon.config import load_config

    cfg = load_config(root / "deploy/config.example.yaml")
    assert cfg.clouds.sim is not None and cfg.site == "lab-1"


def test_policy_explain_breaks_down_the_choice(tmp_path: Path) -> None:
    config = write_config(tmp_path, clouds={"sim": {"seed": 3, "regions_per_cloud": 2,
                                                    "zones_per_region": 2}})
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\nteams:\n  eu: {residency: [eu]}\n")
    r = gpubroker("policy", "explain", str(policy), "--config", str(config), "--format",
                  "json", "--request", json.dumps({"request_id": "x", "gpu": "L4", "gpus": 1,
                                                   "team": "eu"}))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["verdict"]["residency"] == [["eu"]]
    assert report["excluded"]["cloud/region/residency not allowed by the policy"] > 0
    assert report["candidates"]
    for c in report["candidates"]:
        assert c["placement"]["region"] in ("europe-west4", "westeurope", "eu-west-1")
        t = c["terms"]
        assert abs(c["expected_cost_per_hour"] - c["price_per_hour"] * (1 + sum(t.values()))
                   ) < 1e-5
    costs = [c["expected_cost_per_hour"] for c in report["candidates"]]
    assert costs == sorted(costs)
    text = gpubroker("policy", "explain", str(policy), "--config", str(config), "--request",
                     '{"request_id": "x", "gpu": "L4", "gpus": 1}')
    assert "feasible offers" in text.stdout and "expected =" in text.stdout
    bad = gpubroker("policy", "explain", str(policy), "--request", '{"gpu": 1}')
    assert bad.returncode == 2 and "request_id" in bad.stderr


async def test_policy_diff_shows_what_a_new_policy_would_move(tmp_path: Path) -> None:
    from adapters.sim import SimAdapter
    from broker.leasing.book import LeaseBook
    from broker.model import Market, Placement, PlaceRequest, utcnow
    from broker.state.store import StateStore

    config = write_config(tmp_path)
    sim = SimAdapter(seed=3, regions_per_cloud=1, zones_per_region=2)
    offers = [o for r in sim.regions() for o in await sim.poll(r)]
    l4 = next(o for o in offers if o.gpu == "L4" and o.pool.cloud == "gcp"
              and o.pool.market is Market.ON_DEMAND and o.price_per_hour)
    book = LeaseBook()
    lease = book.create(PlaceRequest("s1", "job", ("L4", "T4"), 1, team="ml"),
                        Placement.of(l4, 1), lease_seconds=3600, cap=None, now=utcnow())
    store = StateStore(tmp_path / "state.db")
    await store.open()
    await store.commit([lease], [])
    await store.close()
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text("version: 1\n")
    new.write_text("version: 1\nclouds: {deny: [gcp]}\n")
    r = await asyncio.to_thread(gpubroker, "policy", "diff", str(old), str(new), "--config",
                                str(config), "--format", "json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["active_leases"] == 1
    [row] = report["affected"]
    assert row["lease_id"] == lease.lease_id and row["outcome"] == "moves"
    assert row["to"]["cloud"] != "gcp" and "gcp" in row["why"]
    assert not row["forbidden_already"]
    same = await asyncio.to_thread(gpubroker, "policy", "diff", str(old), str(old),
                                   "--config", str(config))
    assert "0 forbidden" in same.stdout


@pytest.mark.slow
async def test_a_refused_commit_exits_1_with_one_line_naming_the_store_error(
        tmp_path: Path, mosquitto: Mosquitto, probe_factory: ProbeFactory,
        procs: list[Proc]) -> None:
    """Crash-only: another process holds the state file's write lock past SQLite's 5 s
    busy timeout, so the next commit fails; the daemon logs that once and exits 1 for
    systemd to start it again."""
    config = write_config(tmp_path, mosquitto)
    probe = await probe_factory([f"{PREFIX}/status", f"{PREFIX}/events/#"])
    proc = Proc(config, tmp_path / "daemon.log")
    procs.append(proc)
    await wait_online(probe, 0)
    await place(probe, "job-before")
    db = sqlite3.connect(tmp_path / "state.db", isolation_level=None)
    try:
        # Its outbox rows acknowledged and deleted (a condition in another process, with
        # nothing to wait on but the file), so only the next commit meets the lock.
        async with asyncio.timeout(10):
            while db.execute("SELECT count(*) FROM outbox").fetchone()[0]:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        db.execute("BEGIN IMMEDIATE")
        await probe.publish(f"{PREFIX}/requests/s1/place",
                            {"request_id": "job-locked", "gpu": "L4", "gpus": 1})
        code = await asyncio.to_thread(proc.p.wait, 30)
    finally:
        db.close()
    assert code == 1
    text = proc.log.read_text()
    logs = [json.loads(line) for line in text.splitlines() if line.strip()]
    [error] = [e for e in logs if e["level"] == "error"]
    assert error["event"].startswith("state store failed")
    assert error["error"].endswith("commit failed: database is locked (SQLITE_BUSY)")
    assert "Traceback" not in text
    assert not any(e.get("data", {}).get("request_id") == "job-locked"
                   for e in map(payload_json, probe.messages) if "data" in e)
