"""How the daemon process ends: SIGTERM and SIGINT stop it in order (exit 0, `offline`
retained by the daemon itself); after SIGKILL the MQTT will retains `offline` (SPEC §3)."""

from __future__ import annotations

import json
import signal

import pytest
from chaos.harness import PREFIX, StartDaemon, StatusWatcher, parse_ts, retained_snapshot, wall
from mqtt_helpers import Mosquitto


async def retained_status(mosq: Mosquitto) -> dict[str, str] | None:
    raw = (await retained_snapshot(mosq.port, [f"{PREFIX}/status"])).get(f"{PREFIX}/status")
    return json.loads(raw) if raw else None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_orderly_stop_exits_0_and_publishes_offline_itself(
        sig: signal.Signals, chaos_mosquitto: Mosquitto, start_daemon: StartDaemon) -> None:
    daemon = await start_daemon(chaos_mosquitto)
    async with StatusWatcher(chaos_mosquitto.port) as watcher:
        boot = (await watcher.online(20))["boot_id"]
        mark, signalled = watcher.mark(), wall()
        code = await daemon.stop(sig, timeout=20)
        assert code == 0, daemon.log_tail()
        rec = await watcher.wait_for(StatusWatcher.is_state("offline", boot_id=boot), 5,
                                     since=mark)
    assert rec.retain, "`offline` was not published retained"
    # Published at shutdown by the daemon, not the will (which was made at connect time
    # and, on a clean disconnect, is not sent at all).
    ms = signalled.replace(microsecond=signalled.microsecond // 1000 * 1000)  # ts has ms
    assert parse_ts(rec.json()["ts"]) >= ms, rec.json()
    assert daemon.unexpected_exits == []
    status = await retained_status(chaos_mosquitto)
    assert status is not None and status["state"] == "offline"
    assert status["boot_id"] == boot


async def test_sigkill_leaves_offline_to_the_will(
        chaos_mosquitto: Mosquitto, start_daemon: StartDaemon) -> None:
    daemon = await start_daemon(chaos_mosquitto)
    async with StatusWatcher(chaos_mosquitto.port) as watcher:
        boot = (await watcher.online(20))["boot_id"]
        mark = watcher.mark()
        assert await daemon.kill() == -signal.SIGKILL
        rec = await watcher.wait_for(StatusWatcher.is_state("offline", boot_id=boot), 5,
                                     since=mark)
    assert rec.retain, "the will's `offline` was not published retained"
    status = await retained_status(chaos_mosquitto)
    assert status is not None and status["state"] == "offline"
    assert status["boot_id"] == boot
