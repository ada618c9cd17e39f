"""Hybrid capacity end to end: a real daemon on a real mosquitto, the simulated clouds
and a private servers file. A burst larger than the private pool fills the company's
own servers first (each lease told which server) and spills the rest to the clouds, in
one batch; a maintenance window written into the file moves a lease off its server."""

from __future__ import annotations

import asyncio
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import PREFIX, StartDaemon
from mqtt_helpers import ProbeFactory, payload_json

from broker.daemon.config import CloudsConfig, PrivateConfig, SimConfig
from broker.model import Market
from broker.placement.optimizer import BatchResult
from broker.wire.commands import Command

S = "hybrid"
EVENTS = f"{PREFIX}/events/{S}/"


def servers_file(path: Path, *, maintenance: str = "") -> Path:
    path.write_text(textwrap.dedent("""\
        version: 1
        sites:
          onprem:
            residency: [eu]
        groups:
          - name: a100-pod
            site: onprem
            gpu: A100-80GB
            gpus: 8
            vcpus: 96
            memory_gb: 1024
            servers: [gpu-01, gpu-02, gpu-03, gpu-04]
            price_per_gpu_hour: 0
        """) + maintenance)
    return path


def clouds(file: Path) -> CloudsConfig:
    return CloudsConfig(
        sim=SimConfig(seed=11, regions_per_cloud=2, zones_per_region=2,
                      preempt_rate_multiplier=0, signal_interval_seconds=0.05),
        private=PrivateConfig(file=file))


def request(rid: str) -> dict[str, Any]:
    return {"request_id": rid, "gpu": "A100-80GB", "gpus": 8, "market": "any",
            "lease_seconds": 3600}


async def test_a_burst_fills_the_private_servers_first_and_spills_to_the_cloud(
        start_daemon: StartDaemon, probe_factory: ProbeFactory, tmp_path: Path) -> None:
    file = servers_file(tmp_path / "private.yaml")
    rd = await start_daemon(config={"clouds": clouds(file)})
    broker, bus = rd.daemon.broker, rd.daemon.bus
    batches: list[BatchResult] = []
    broker.batch_observers.append(batches.append)
    # The burst arrives while the broker is busy placing a request (here: its lock
    # held, as during a long failover): the burst queues up, and the next batch takes
    # it all.
    arrived: list[Command] = []
    counts = {1: asyncio.Event(), 11: asyncio.Event()}
    submit = bus._on_command

    async def counted(command: Command) -> None:
        await submit(command)
        arrived.append(command)
        if len(arrived) in counts:
            counts[len(arrived)].set()

    bus._on_command = counted
    probe = await probe_factory([f"{PREFIX}/events/#", f"{PREFIX}/leases/#"])
    async with broker._lock:
        await probe.publish(f"{PREFIX}/requests/{S}/place",
                            {**request("busy"), "gpu": "T4", "gpus": 1})
        async with asyncio.timeout(10):
            await counts[1].wait()
        for i in range(10):
            await probe.publish(f"{PREFIX}/requests/{S}/place", request(f"r{i}"))
        async with asyncio.timeout(10):
            await counts[11].wait()
    decided = await probe.wait_for_count(EVENTS + "placement.decided", 11, timeout=15)
    decided = [m for m in decided if payload_json(m)["data"]["request_id"] != "busy"]
    placements = [payload_json(m)["data"]["placement"] for m in decided]
    private = [p for p in placements if p["cloud"] == "private"]
    cloud = [p for p in placements if p["cloud"] != "private"]
    assert len(private) == 4 and len(cloud) == 6
    assert all(p["market"] == "reserved" and p["price_per_hour"] == 0 for p in private)
    assert sorted(t["id"] for p in private for t in p["targets"]) == \
        ["gpu-01", "gpu-02", "gpu-03", "gpu-04"]
    assert all("targets" not in p and p["market"] in ("spot", "on_demand") for p in cloud)
    # One batch placed the burst (after the one request the broker was busy with).
    assert [len(b.outcomes) for b in batches] == [1, 10]
    # The retained lease state names the server too; the pool has none free.
    lease_id = next(payload_json(m)["data"]["lease_id"] for m in decided
                    if payload_json(m)["data"]["placement"]["cloud"] == "private")
    state = await probe.wait_for(f"{PREFIX}/leases/{S}/{lease_id}")
    assert payload_json(state)["placement"]["targets"][0]["id"].startswith("gpu-0")
    key = next(o.pool for o in rd.daemon.pool if o.pool.cloud == "private")
    assert key.market is Market.RESERVED and rd.daemon.pool.free_capacity(key) == 0
    assert rd.daemon.pool.idle_owned_gpus() == 0 and rd.daemon.pool.owned_gpus == 32


async def test_a_maintenance_window_moves_the_lease_off_its_server(
        start_daemon: StartDaemon, probe_factory: ProbeFactory, tmp_path: Path) -> None:
    file = servers_file(tmp_path / "private.yaml")
    rd = await start_daemon(config={"clouds": clouds(file)})
    probe = await probe_factory([f"{PREFIX}/events/#"])
    await probe.publish(f"{PREFIX}/requests/{S}/place", request("job"))
    msg = await probe.wait_for(EVENTS + "placement.decided", timeout=10)
    data = payload_json(msg)["data"]
    [target] = data["placement"]["targets"]
    server = target["id"]
    # The ops team announces a window on that server, starting in 10 minutes (inside
    # the default 30-minute lead): the file is read again at the next poll.
    start = datetime.now(UTC) + timedelta(minutes=10)
    servers_file(file, maintenance=textwrap.dedent(f"""\
        maintenance:
          - servers: [{server}]
            drain_from: {start.isoformat()}
            drain_until: {(start + timedelta(hours=2)).isoformat()}
            reason: firmware
        """))
    mark = probe.mark()
    await rd.daemon.poller.poll_all()
    moved = await probe.wait_for(EVENTS + "lease.failover", timeout=10, since=mark)
    out = payload_json(moved)["data"]
    assert out["lease_id"] == data["lease_id"] and out["reason"] == "maintenance"
    assert out["epoch"] == 2
    # Another server of the same group, paid-for capacity still first.
    assert out["to"]["cloud"] == "private" and out["from"]["targets"] == [target]
    assert [t["id"] for t in out["to"]["targets"]] != [server]
    assert server in out["detail"]


async def test_idle_paid_for_gpu_hours_are_counted(
        start_daemon: StartDaemon, probe_factory: ProbeFactory, tmp_path: Path) -> None:
    rd = await start_daemon(config={"clouds": clouds(servers_file(tmp_path / "p.yaml"))})
    registry = rd.daemon.metrics.registry
    assert registry.get_sample_value("gpubroker_owned_gpus") == 32
    assert registry.get_sample_value("gpubroker_idle_owned_gpus") == 32
    probe = await probe_factory([f"{PREFIX}/events/#"])
    for i in range(4):
        await probe.publish(f"{PREFIX}/requests/{S}/place", request(f"r{i}"))
    await probe.wait_for_count(EVENTS + "placement.decided", 4, timeout=10)
    idle_then = registry.get_sample_value("gpubroker_idle_owned_gpu_hours_total")
    assert idle_then is not None and idle_then > 0  # 32 idle GPUs since the first poll
    assert registry.get_sample_value("gpubroker_idle_owned_gpus") == 0
    # All four servers are leased: the idle GPU-hours stop growing.
    assert registry.get_sample_value("gpubroker_idle_owned_gpu_hours_total") == \
        pytest.approx(idle_then, abs=1e-9)
