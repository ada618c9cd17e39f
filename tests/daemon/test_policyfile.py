"""Policies enforced end to end through MQTT, and reloaded live."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import yaml
from daemon_helpers import PREFIX, StartDaemon
from mqtt_helpers import Mosquitto, MqttProbe, ProbeFactory, payload_json

S = "sched-1"


def write_policy(path: Path, body: str) -> Path:
    path.write_text("version: 1\n" + textwrap.dedent(body))
    return path


async def ask(probe: MqttProbe, body: dict[str, Any]) -> dict[str, Any]:
    mark = probe.mark()
    await probe.publish(f"{PREFIX}/requests/{S}/place", body)
    msg = await probe.wait_for(
        lambda m: str(m.topic).startswith(f"{PREFIX}/events/{S}/placement.")
        and payload_json(m)["data"].get("request_id") == body["request_id"], since=mark)
    return payload_json(msg)  # type: ignore[no-any-return]


async def test_budget_and_residency_are_enforced(start_daemon: StartDaemon,
                                                 probe_factory: ProbeFactory,
                                                 tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "policy.yaml", """
        teams:
          ml: {max_gpus: 8, budget_per_hour: 1000}
          eu: {residency: [eu]}
          tight: {budget_per_hour: 5}
        rules:
          - name: no-b200
            match: {gpu: B200}
            deny: "B200s are reserved"
    """)
    await start_daemon(policy_file=policy)
    probe = await probe_factory([f"{PREFIX}/events/#"])
    first = await ask(probe, {"request_id": "a", "gpu": "L4", "gpus": 8, "team": "ml"})
    assert first["type"].endswith("placement.decided.v1")
    over = await ask(probe, {"request_id": "b", "gpu": "L4", "gpus": 1, "team": "ml"})
    assert over["data"]["code"] == "over_budget" and "max_gpus 8" in over["data"]["detail"]

    eu = await ask(probe, {"request_id": "c", "gpu": ["A100-80GB", "A100-40GB", "H100-80GB",
                                                      "L4", "T4"], "gpus": 1, "team": "eu"})
    assert eu["type"].endswith("placement.decided.v1"), eu
    assert eu["data"]["placement"]["region"] in ("europe-west4", "westeurope", "eu-west-1")

    money = await ask(probe, {"request_id": "d", "gpu": "H100-80GB", "gpus": 8,
                              "team": "tight"})
    assert money["data"]["code"] == "over_budget" and "budget_per_hour" in money["data"]["detail"]

    deny = await ask(probe, {"request_id": "e", "gpu": "B200", "gpus": 8})
    assert deny["data"]["code"] == "policy_denied" and "no-b200" in deny["data"]["detail"]
    assert "reserved" in deny["data"]["detail"]


async def test_a_policy_change_is_applied_live_and_moves_forbidden_leases(
        start_daemon: StartDaemon, probe_factory: ProbeFactory, tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "policy.yaml", "teams:\n  ml: {}\n")
    rd = await start_daemon(policy_file=policy)
    probe = await probe_factory([f"{PREFIX}/events/#"])
    d = (await ask(probe, {"request_id": "a", "gpu": "L4", "gpus": 1, "team": "ml",
                           "clouds": ["aws", "gcp"]}))["data"]
    assert d["placement"]["cloud"] in ("aws", "gcp")
    banned = d["placement"]["cloud"]
    other = "gcp" if banned == "aws" else "aws"

    # A broken file keeps the running policy and says why on the ops topic. The daemon
    # notices the change itself (it checks the file every 2 s).
    mark = probe.mark()
    policy.write_text("version: 1\nclouds: {deny: [awz]}\n")
    rejected = payload_json(await probe.wait_for(f"{PREFIX}/events/_ops/policy.rejected",
                                                 since=mark))
    assert rejected["data"]["errors"][0]["key"] == "clouds.deny[0]"
    assert "did you mean" in rejected["data"]["errors"][0]["message"]
    assert rd.daemon.broker.policy.clouds.deny == []

    assert await rd.daemon.reload_policy() == "rejected"  # the same bad content: no news
    assert len(probe.matching(f"{PREFIX}/events/_ops/policy.rejected", since=mark)) == 1

    mark = probe.mark()
    write_policy(policy, f"teams:\n  ml: {{}}\nclouds: {{deny: [{banned}]}}\n")
    applied = payload_json(await probe.wait_for(f"{PREFIX}/events/_ops/policy.applied",
                                                since=mark))
    assert applied["data"]["hash"] == rd.daemon.policy_digest
    assert applied["data"]["leases_to_move"] == 1
    moved = payload_json(await probe.wait_for(f"{PREFIX}/events/{S}/lease.failover",
                                              since=mark))["data"]
    assert moved["reason"] == "policy_changed" and moved["to"]["cloud"] == other
    assert banned in moved["detail"]
    # Unchanged content is not applied twice.
    assert await rd.daemon.reload_policy() == "unchanged"


async def test_sighup_reloads_the_policy_of_a_running_daemon(
        tmp_path: Path, mosquitto: Mosquitto, probe_factory: ProbeFactory) -> None:
    policy = write_policy(tmp_path / "policy.yaml", "defaults: {market: any}\n")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({
        "state": {"path": str(tmp_path / "state.db")}, "policy_file": str(policy),
        "mqtt": {"url": mosquitto.url}, "http": {"listen": None},
        "poll": {"interval_seconds": 3600, "stale_after_seconds": 7200},
        "clouds": {"sim": {"regions_per_cloud": 1, "zones_per_region": 1}}}))
    probe = await probe_factory([f"{PREFIX}/#"])
    log = (tmp_path / "daemon.log").open("wb")
    proc = subprocess.Popen(  # noqa: ASYNC220 - starting it is instant; it is waited on below
        [sys.executable, "-m", "broker.cli", "run", "--config", str(cfg)],
        stdout=log, stderr=log)
    try:
        await probe.wait_for(lambda m: str(m.topic) == f"{PREFIX}/status" and m.payload
                             and payload_json(m)["state"] == "online", timeout=20)
        # Rewrite the file without changing its size or mtime resolution concerns: SIGHUP
        # forces a read whatever the watcher saw.
        mark = probe.mark()
        write_policy(policy, "defaults: {market: spot}\n")
        proc.send_signal(signal.SIGHUP)
        applied = payload_json(await probe.wait_for(
            f"{PREFIX}/events/_ops/policy.applied", since=mark, timeout=10))
        assert applied["data"]["file"] == str(policy)
        d = await ask(probe, {"request_id": "x", "gpu": ["L4", "T4", "A10G"], "gpus": 1})
        assert d["data"]["placement"]["market"] == "spot"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
