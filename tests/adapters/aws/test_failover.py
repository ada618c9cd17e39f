"""The daemon on the AWS adapter: a spot interruption notice on the SQS queue fails the
lease over, published on a real mosquitto."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from fake_aws import FakeAWS, fake_aws_fixture  # noqa: F401
from mqtt_helpers import Mosquitto, ProbeFactory, payload_json

from broker.daemon.assembly import Daemon
from broker.daemon.config import (
    AwsConfig,
    CloudsConfig,
    Config,
    HttpConfig,
    MqttConfig,
    PollConfig,
    SimConfig,
    StateConfig,
)
from broker.model import PoolKey

PREFIX = "gpubroker/v1"
REGION = "us-east-1"


async def test_interruption_notice_fails_the_lease_over(
        fake_aws: FakeAWS, mosquitto: Mosquitto, probe_factory: ProbeFactory,
        tmp_path: Path) -> None:
    queue = fake_aws.create_queue(REGION, "interruptions")
    cfg = Config(
        site="aws-test", state=StateConfig(path=tmp_path / "state.db"),
        mqtt=MqttConfig(url=mosquitto.url), http=HttpConfig(listen=None),
        poll=PollConfig(interval_seconds=3600, stale_after_seconds=7200),
        clouds=CloudsConfig(aws=AwsConfig(regions=[REGION], endpoint=fake_aws.url,
                                          interruption_queue_url=queue)))
    daemon = Daemon(cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:
        async with asyncio.timeout(30):
            await daemon.ready.wait()
        probe = await probe_factory([f"{PREFIX}/events/#"])
        await probe.publish(f"{PREFIX}/requests/s1/place",
                            {"request_id": "j1", "gpu": "A10G", "gpus": 1, "market": "spot"})
        decided = payload_json(await probe.wait_for(f"{PREFIX}/events/s1/placement.decided"))
        placement = decided["data"]["placement"]
        assert placement["cloud"] == "aws" and placement["market"] == "spot"

        # The scheduler launched the instance; AWS now reclaims it.
        ec2 = fake_aws.client("ec2", REGION)
        r = ec2.run_instances(ImageId="ami-12c6146b", InstanceType=placement["instance_type"],
                              MinCount=1, MaxCount=1,
                              Placement={"AvailabilityZone": placement["zone"]},
                              InstanceMarketOptions={"MarketType": "spot"})
        instance_id = r["Instances"][0]["InstanceId"]
        sent = time.monotonic()
        fake_aws.send_ec2_event(queue, "EC2 Spot Instance Interruption Warning",
                                {"instance-id": instance_id, "instance-action": "terminate"})
        msg = await probe.wait_for(f"{PREFIX}/events/s1/lease.failover", timeout=15)
        latency = time.monotonic() - sent
        f = payload_json(msg)["data"]
        assert f["reason"] == "interrupted" and f["epoch"] == 2
        assert instance_id in f["detail"]
        assert PoolKey.from_json(f["to"]) != PoolKey.from_json(placement)
        print(f"interruption notice sent -> lease.failover received: {latency * 1000:.0f} ms")
        assert latency < 10
    finally:
        stop.set()
        async with asyncio.timeout(30):
            await task


def aws_config(tmp_path: Path, mosquitto: Mosquitto, fake_aws: FakeAWS, **clouds: object
               ) -> Config:
    return Config(
        site="aws-test", state=StateConfig(path=tmp_path / "state.db"),
        mqtt=MqttConfig(url=mosquitto.url), http=HttpConfig(listen=None),
        poll=PollConfig(interval_seconds=3600, stale_after_seconds=7200),
        clouds=CloudsConfig(aws=AwsConfig(regions=[REGION], endpoint=fake_aws.url),
                            **clouds))  # type: ignore[arg-type]


async def test_an_aws_api_outage_is_not_a_capacity_loss(
        fake_aws: FakeAWS, mosquitto: Mosquitto, probe_factory: ProbeFactory,
        tmp_path: Path) -> None:
    daemon = Daemon(aws_config(tmp_path, mosquitto, fake_aws))
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:
        async with asyncio.timeout(30):
            await daemon.ready.wait()
        probe = await probe_factory([f"{PREFIX}/events/#"])
        await probe.publish(f"{PREFIX}/requests/s1/place",
                            {"request_id": "j1", "gpu": "L4", "gpus": 1})
        decided = payload_json(await probe.wait_for(f"{PREFIX}/events/s1/placement.decided"))
        adapter = daemon.adapter("aws")
        adapter.sdk.retry.max_backoff = 0.05  # type: ignore[attr-defined]
        fake_aws.fail("DescribeSpotPriceHistory", code="InternalError", status=500, times=None)
        [result] = await daemon.poller.poll_all()
        assert result.error is not None
        assert daemon.pool.failing(("aws", REGION))
        # The lease stays where it is; its pool's offers only age.
        lease = daemon.book.get(decided["data"]["lease_id"])
        assert lease is not None and lease.state.value == "active" and lease.epoch == 1
        assert not probe.matching(f"{PREFIX}/events/s1/lease.failover")
        fake_aws.clear_faults()
        [result] = await daemon.poller.poll_all()
        assert result.error is None and not daemon.pool.failing(("aws", REGION))
    finally:
        stop.set()
        async with asyncio.timeout(30):
            await task


async def test_aws_without_credentials_is_unhealthy_and_the_daemon_runs_on(
        fake_aws: FakeAWS, mosquitto: Mosquitto, probe_factory: ProbeFactory,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var)
    daemon = Daemon(aws_config(tmp_path, mosquitto, fake_aws,
                               sim=SimConfig(clouds=["gcp"], regions_per_cloud=1)))
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:
        async with asyncio.timeout(30):
            await daemon.ready.wait()
        health = {h.slice: h for h in daemon.pool.health()}
        assert not health[("aws", REGION)].ok
        assert "credentials" in (health[("aws", REGION)].last_error or "")
        probe = await probe_factory([f"{PREFIX}/events/#"])
        await probe.publish(f"{PREFIX}/requests/s1/place",
                            {"request_id": "j2", "gpu": "L4", "gpus": 1})
        decided = payload_json(await probe.wait_for(f"{PREFIX}/events/s1/placement.decided"))
        assert decided["data"]["placement"]["cloud"] == "gcp"
    finally:
        stop.set()
        async with asyncio.timeout(30):
            await task
