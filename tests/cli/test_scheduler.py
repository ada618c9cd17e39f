"""`gpubroker place | leases | release` and `examples/scheduler.py` as people run them:
real processes against the real daemon (in-process, on a private mosquitto).

The commands run as asyncio subprocesses, so the daemon keeps serving on the test's
event loop meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import yaml
from daemon_helpers import RunningDaemon, StartDaemon, daemon_config
from mqtt_helpers import Mosquitto, free_port

from broker.daemon.assembly import Daemon
from broker.daemon.config import HttpConfig
from broker.model import LeaseState
from gpubroker_client import BrokerClient

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "GPUBROKER_SCHEDULER": ""}


async def gpubroker(*args: str, timeout: float = 30) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "broker.cli", *args, cwd=ROOT, env=ENV,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def one_line_error(err: str) -> str:
    """What a person sees on a mistake: one line, no traceback."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("gpubroker: "), err
    return lines[0]


async def readline(stream: asyncio.StreamReader, timeout: float = 10) -> str:
    line = await asyncio.wait_for(stream.readline(), timeout)
    assert line, "the process closed its output"
    return line.decode().rstrip("\n")


@contextlib.asynccontextmanager
async def daemon_with_http(mosquitto: Mosquitto, tmp_path: Path
                           ) -> AsyncIterator[tuple[RunningDaemon, str]]:
    """The test daemon with its HTTP API on (the `start_daemon` fixture turns it off)."""
    listen = f"127.0.0.1:{free_port()}"
    cfg = daemon_config(mosquitto, tmp_path / "state.db").model_copy(
        update={"http": HttpConfig(listen=listen)})
    daemon = Daemon(cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    rd = RunningDaemon(daemon, task, stop)
    try:
        async with asyncio.timeout(15):
            await daemon.ready.wait()
        yield rd, listen
    finally:
        await rd.stop()


async def test_place_prints_the_lease_for_a_person_and_as_json(start_daemon: StartDaemon,
                                                               mosquitto: Mosquitto) -> None:
    rd = await start_daemon()
    rc, out, err = await gpubroker("place", "--mqtt", mosquitto.url, "--gpu", "A100-80GB",
                                   "H100-80GB", "--gpus", "8", "--market", "spot",
                                   "--scheduler", "train", "--request-id", "job-1",
                                   "--label", "job=llm", "--lease-seconds", "600")
    assert rc == 0, err
    lease = rd.daemon.book.find("train", "job-1")
    assert lease is not None and lease.state is LeaseState.ACTIVE
    assert lease.request.labels == {"job": "llm"} and lease.lease_seconds == 600
    p = lease.placement
    lines = out.splitlines()
    assert lines[0] == f"placed {lease.lease_id} for request job-1 (scheduler train, epoch 1)"
    text = "\n".join(lines[1:])
    assert f"{p.pool.cloud} {p.pool.region}, zone {p.pool.zone}, {p.pool.instance_type}, " \
           f"spot" in text
    plural = "s" if p.instances != 1 else ""
    assert f"{p.instances} instance{plural} × {p.gpus} {p.gpu} = {p.total_gpus} GPUs" in text
    assert f"${p.price_per_gpu_hour:.4f} per GPU-hour, ${p.price_per_hour:.2f} per hour" in text
    assert re.search(r"expires: +20\d\d-\d\d-\d\d \d\d:\d\d:\d\d UTC \(in (9m \d+s|10m 0s)\) "
                     r"unless its scheduler renews it", text), text
    assert "why:" in text

    # The same request id again: the same lease, here as JSON.
    rc, out, err = await gpubroker("place", "--mqtt", mosquitto.url, "--gpu", "A100-80GB",
                                   "--gpus", "8", "--scheduler", "train", "--request-id",
                                   "job-1", "--format", "json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["lease_id"] == lease.lease_id and data["placement"] == p.to_json()
    assert len([le for le in rd.daemon.book.all() if le.request_id == "job-1"]) == 1


async def test_place_errors_are_one_line_with_the_exit_code(start_daemon: StartDaemon,
                                                            mosquitto: Mosquitto) -> None:
    await start_daemon()
    rc, out, err = await gpubroker("place", "--mqtt", mosquitto.url, "--gpu", "H100-80GB",
                                   "--gpus", "8", "--max-price", "0.01", "--request-id", "c")
    assert rc == 1 and out == ""
    assert "request c rejected: over_price_cap: " in one_line_error(err)
    assert "retry after" in err

    rc, out, err = await gpubroker("place", "--mqtt", mosquitto.url, "--gpu", "T4",
                                   "--gpus", "0")
    assert rc == 2 and out == ""
    assert one_line_error(err).startswith("gpubroker: invalid request: gpus: ")

    rc, _, err = await gpubroker("place", "--mqtt", mosquitto.url, "--gpu", "T4", "--gpus",
                                 "1", "--label", "nokey")
    assert rc == 2 and "KEY=VALUE" in one_line_error(err)


async def test_an_unreachable_server_is_an_error_in_seconds() -> None:
    dead = f"mqtt://127.0.0.1:{free_port()}"
    started = time.monotonic()
    runs = await asyncio.gather(
        gpubroker("place", "--mqtt", dead, "--gpu", "T4", "--gpus", "1", "--timeout", "2"),
        gpubroker("leases", "--mqtt", dead, "--timeout", "2"),
        gpubroker("release", "L-1", "--mqtt", dead, "--timeout", "2"))
    assert time.monotonic() - started < 6  # a dead server is an error in seconds
    for rc, out, err in runs:
        assert rc == 1 and out == ""
        assert "cannot reach the MQTT server at 127.0.0.1:" in one_line_error(err)
    rc, _, err = await gpubroker("leases", "--http", f"127.0.0.1:{free_port()}")
    assert rc == 1 and "cannot read the daemon's HTTP API" in one_line_error(err)


async def test_usage_mistakes_exit_2_in_one_line(tmp_path: Path) -> None:
    dead = f"mqtt://127.0.0.1:{free_port()}"
    bad = tmp_path / "config.yaml"
    bad.write_text("mqtt:\n  url: nope\n")
    runs = await asyncio.gather(
        *(gpubroker("release", "L-1", "--mqtt", url)
          for url in ("http://127.0.0.1:1883", "127.0.0.1:99999", "mqtt://")),
        gpubroker("release", "L-1", "--scheduler", "no such id", "--mqtt", dead),
        gpubroker("leases", "--config", str(bad)),
        gpubroker("leases", "--config", str(tmp_path / "missing.yaml")))
    expected = ["MQTT URL", "MQTT URL", "MQTT URL", "scheduler id", "mqtt.url", "missing.yaml"]
    for (rc, out, err), words in zip(runs, expected, strict=True):
        assert rc == 2 and out == ""
        assert words in one_line_error(err)


async def test_release(start_daemon: StartDaemon, mosquitto: Mosquitto,
                       tmp_path: Path) -> None:
    rd = await start_daemon()
    async with BrokerClient(mosquitto.url, scheduler="train") as c:
        lease = await c.place(gpu="T4", gpus=1)
    # Connection settings and the scheduler id (its MQTT username) from the config.
    config = tmp_path / "client.yaml"
    config.write_text(yaml.safe_dump({"mqtt": {"url": mosquitto.url, "username": "train"}}))
    rc, out, err = await gpubroker("release", lease.lease_id, "--config", str(config))
    assert (rc, out) == (0, f"released {lease.lease_id}\n"), err
    assert rd.daemon.book.get(lease.lease_id).state is LeaseState.RELEASED  # type: ignore[union-attr]
    rc, out, _ = await gpubroker("release", lease.lease_id, "--mqtt", mosquitto.url,
                                 "--scheduler", "train")
    assert rc == 0 and lease.lease_id in out  # idempotent

    rc, out, err = await gpubroker("release", "L-nope", "--mqtt", mosquitto.url,
                                   "--scheduler", "train")
    assert rc == 1 and out == ""
    assert one_line_error(err) == ("gpubroker: scheduler train has no lease L-nope "
                                   "(another scheduler's? give its --scheduler)")
    async with BrokerClient(mosquitto.url, scheduler="train") as c:
        theirs = await c.place(gpu="T4", gpus=1)
    rc, _, err = await gpubroker("release", theirs.lease_id, "--mqtt", mosquitto.url)
    assert rc == 1 and "scheduler cli has no lease" in one_line_error(err)
    assert rd.daemon.book.get(theirs.lease_id).state is LeaseState.ACTIVE  # type: ignore[union-attr]


async def test_renew(start_daemon: StartDaemon, mosquitto: Mosquitto) -> None:
    rd = await start_daemon()
    async with BrokerClient(mosquitto.url, scheduler="train") as c:
        lease = await c.place(gpu="T4", gpus=1, lease_seconds=600)
    before = rd.daemon.book.get(lease.lease_id).expires_at  # type: ignore[union-attr]
    rc, out, err = await gpubroker("renew", lease.lease_id, "--mqtt", mosquitto.url,
                                   "--scheduler", "train")
    assert rc == 0 and out.startswith(f"renewed {lease.lease_id}; expires "), err
    assert rd.daemon.book.get(lease.lease_id).expires_at > before  # type: ignore[union-attr]

    rc, out, err = await gpubroker("renew", "L-nope", "--mqtt", mosquitto.url,
                                   "--scheduler", "train")
    assert rc == 1 and out == ""
    assert one_line_error(err) == ("gpubroker: scheduler train has no lease L-nope "
                                   "(another scheduler's? give its --scheduler)")
    async with BrokerClient(mosquitto.url, scheduler="train") as c:
        await c.release(lease.lease_id)
    rc, out, err = await gpubroker("renew", lease.lease_id, "--mqtt", mosquitto.url,
                                   "--scheduler", "train", "--timeout", "10")
    assert rc == 1 and out == ""
    assert one_line_error(err) == (f"gpubroker: {lease.lease_id} has released; it cannot "
                                   "be renewed")


async def test_report(start_daemon: StartDaemon, mosquitto: Mosquitto) -> None:
    rd = await start_daemon()
    async with BrokerClient(mosquitto.url, scheduler="train") as c:
        lease = await c.place(gpu=["A100-80GB", "H100-80GB"], gpus=8)
    rc, out, err = await gpubroker("report", lease.lease_id, "--kind", "launch_failed",
                                   "--detail", "InsufficientInstanceCapacity",
                                   "--mqtt", mosquitto.url, "--scheduler", "train")
    assert rc == 0, err
    held = rd.daemon.book.get(lease.lease_id)
    assert held is not None and held.epoch == 2
    assert out == (f"moved {lease.lease_id} to epoch 2: {held.placement.instances} instance"
                   f"{'s' if held.placement.instances != 1 else ''} × {held.placement.gpus} "
                   f"{held.placement.gpu} {held.placement.pool.cloud}/"
                   f"{held.placement.pool.zone} {held.placement.pool.instance_type} "
                   f"{held.placement.pool.market.value} (reported)\n")
    rc, _, err = await gpubroker("report", "L-nope", "--kind", "unhealthy",
                                 "--mqtt", mosquitto.url, "--scheduler", "train")
    assert rc == 1 and "scheduler train has no lease L-nope" in one_line_error(err)
    rc, _, err = await gpubroker("report", lease.lease_id, "--kind", "sad",
                                 "--mqtt", mosquitto.url)
    assert rc == 2 and "invalid choice" in err


async def test_leases_from_mqtt(start_daemon: StartDaemon, mosquitto: Mosquitto) -> None:
    await start_daemon()
    async with BrokerClient(mosquitto.url, scheduler="train") as a, \
            BrokerClient(mosquitto.url, scheduler="infer") as b:
        mine = await a.place(gpu=["A100-80GB", "H100-80GB"], gpus=8, request_id="job-a")
        theirs = await b.place(gpu="L4", gpus=1, request_id="job-b")
        gone = await b.place(gpu="T4", gpus=1, request_id="job-c")
        await gone.release()

    rc, out, err = await gpubroker("leases", "--mqtt", mosquitto.url)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["LEASE", "SCHEDULER", "REQUEST", "STATE", "EPOCH"]
    assert lines[-1] == "2 leases"
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert set(rows) == {mine.lease_id, theirs.lease_id}
    p = mine.placement
    assert f"{p.instances} × {p.gpus} {p.gpu}" in rows[mine.lease_id]
    assert f"{p.price_per_gpu_hour:.4f}" in rows[mine.lease_id]
    assert "in 14m" in rows[mine.lease_id]

    rc, out, err = await gpubroker("leases", "--mqtt", mosquitto.url, "--scheduler", "infer",
                                   "--format", "json")
    assert rc == 0, err
    listed = [json.loads(line) for line in out.splitlines()]
    assert [le["lease_id"] for le in listed] == [theirs.lease_id]
    assert listed[0]["placement"] == theirs.placement.to_json()

    rc, _, err = await gpubroker("leases", "--mqtt", mosquitto.url, "--state", "released")
    assert rc == 2 and "needs the daemon's HTTP API" in one_line_error(err)


async def test_leases_from_the_http_api(mosquitto: Mosquitto, tmp_path: Path) -> None:
    async with daemon_with_http(mosquitto, tmp_path) as (_, listen):
        async with BrokerClient(mosquitto.url, scheduler="train") as c:
            kept = await c.place(gpu="T4", gpus=1)
            gone = await c.place(gpu="L4", gpus=1)
            await gone.release()
        rc, out, err = await gpubroker("leases", "--http", listen, "--format", "json")
        assert rc == 0, err
        assert [json.loads(line)["lease_id"] for line in out.splitlines()] == [kept.lease_id]
        # --config naming http.listen means HTTP: ended leases are there too.
        config = tmp_path / "client.yaml"
        config.write_text(yaml.safe_dump({"mqtt": {"url": mosquitto.url},
                                          "http": {"listen": listen}}))
        rc, out, err = await gpubroker("leases", "--config", str(config), "--state", "all")
        assert rc == 0, err
        states = {line.split()[0]: line.split()[3] for line in out.splitlines()[1:-1]}
        assert states == {kept.lease_id: "active", gone.lease_id: "released"}
        assert out.splitlines()[-1] == "2 leases"


async def test_leases_watch_follows_changes_until_ctrl_c(start_daemon: StartDaemon,
                                                         mosquitto: Mosquitto) -> None:
    rd = await start_daemon()
    async with BrokerClient(mosquitto.url, scheduler="train") as c:
        before = await c.place(gpu="A10G", gpus=1)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "broker.cli", "leases", "--watch", "--format", "json",
            "--mqtt", mosquitto.url, cwd=ROOT, env=ENV, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        try:
            first = json.loads(await readline(proc.stdout))
            assert (first["change"], first["lease_id"]) == ("present", before.lease_id)
            assert "watching for changes" in await readline(proc.stderr)

            async def change() -> dict[str, Any]:
                assert proc.stdout is not None
                return json.loads(await readline(proc.stdout))  # type: ignore[no-any-return]

            lease = await c.place(gpu="T4", gpus=1, request_id="watched")
            placed = await change()
            assert (placed["change"], placed["lease_id"]) == ("placed", lease.lease_id)
            assert placed["scheduler"] == "train" and placed["lease"]["epoch"] == 1
            await lease.renew()
            assert (await change())["change"] == "renewed"
            rd.sim.interrupt(lease.placement.pool)
            moved = await change()
            assert (moved["change"], moved["reason"]) == ("failover", "interrupted")
            assert moved["lease"]["placement"] == lease.placement.to_json()
            await lease.release()
            ended = await change()
            assert (ended["change"], ended["lease_id"]) == ("released", lease.lease_id)

            started = time.monotonic()
            proc.send_signal(signal.SIGINT)
            assert await asyncio.wait_for(proc.wait(), 5) == 0
            assert time.monotonic() - started < 2
            assert "Traceback" not in (await proc.stderr.read()).decode()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_the_example_scheduler(start_daemon: StartDaemon, mosquitto: Mosquitto) -> None:
    """examples/scheduler.py places its jobs, follows a failover, releases on Ctrl-C."""
    rd = await start_daemon()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "examples" / "scheduler.py"), "--mqtt", mosquitto.url,
        "--scheduler", "example", "--lease-seconds", "30", cwd=ROOT, env=ENV,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        assert (await readline(proc.stdout)).startswith("scheduler example on mqtt://")
        placed = {}
        for _ in range(3):
            job, what = (await readline(proc.stdout)).split(maxsplit=1)
            assert what.startswith("placed L-"), what
            placed[job] = what.split()[1].rstrip(":")
        assert set(placed) == {"pretrain", "finetune", "eval"}
        lease = rd.daemon.book.get(placed["pretrain"])
        assert lease is not None and lease.scheduler == "example"
        rd.sim.interrupt(lease.placement.pool)
        moved = await readline(proc.stdout)
        assert moved.startswith("pretrain  moved (interrupted), restarting at epoch 2: "), moved

        proc.send_signal(signal.SIGINT)
        rest = (await asyncio.wait_for(proc.stdout.read(), 10)).decode().splitlines()
        assert await asyncio.wait_for(proc.wait(), 5) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert rest[0] == "releasing 3 lease(s)"
    assert sorted(rest[1:]) == ["eval      released", "finetune  released",
                                "pretrain  released"]
    assert not [le for le in rd.daemon.book.active() if le.scheduler == "example"]
    assert (await proc.stderr.read()) == b""
