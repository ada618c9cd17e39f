"""AWS capacity reservations offered in the `reserved` market: the AWS adapter with real
boto3 against the fake AWS endpoint, which serves EC2's capacity reservation calls
(moto has none)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from factories import reserved
from fake_aws import FakeAWS, fake_aws_fixture  # noqa: F401
from structlog.testing import capture_logs

from adapters.aws.adapter import AwsAdapter, from_config
from broker.daemon.config import AwsConfig, ReservationsConfig
from broker.model import Market, PoolKey, Target

REGION = "us-east-1"
PERMISSION = "ec2:DescribeCapacityReservations"


def make(fake: FakeAWS, **kwargs: Any) -> AwsAdapter:
    kwargs.setdefault("reservations", True)
    a = AwsAdapter(regions=[REGION], endpoint=fake.url, **kwargs)
    a.sdk.retry.max_backoff = 0.05
    return a


@pytest.fixture
async def adapter(fake_aws: FakeAWS) -> AsyncIterator[AwsAdapter]:
    a = make(fake_aws, reservation_price_per_gpu_hour=0.25)
    yield a
    await a.close()


def key(zone: str, itype: str) -> PoolKey:
    return PoolKey("aws", REGION, zone, itype, Market.RESERVED)


def create(fake: FakeAWS, zone: str, itype: str, count: int, **kwargs: Any) -> str:
    """A reservation made the way an operator makes one: CreateCapacityReservation."""
    resp = fake.client("ec2", REGION).create_capacity_reservation(
        InstanceType=itype, InstancePlatform="Linux/UNIX", AvailabilityZone=zone,
        InstanceCount=count, **kwargs)
    return str(resp["CapacityReservation"]["CapacityReservationId"])


async def test_reservations_become_reserved_offers_grouped_by_zone_and_type(
        fake_aws: FakeAWS, adapter: AwsAdapter) -> None:
    a = create(fake_aws, "us-east-1a", "p4d.24xlarge", 2, InstanceMatchCriteria="targeted")
    b = create(fake_aws, "us-east-1a", "p4d.24xlarge", 3)
    c = create(fake_aws, "us-east-1b", "p4d.24xlarge", 1)
    g = create(fake_aws, "us-east-1a", "g5.xlarge", 4)
    fake_aws.use_capacity_reservation(b, 1)
    # More than a page of them (five a page): every page is read.
    extra = [create(fake_aws, "us-east-1c", "g5.xlarge", 1) for _ in range(4)]

    offers = await adapter.poll(REGION)
    got = reserved(offers)
    assert set(got) == {key("us-east-1a", "p4d.24xlarge"), key("us-east-1b", "p4d.24xlarge"),
                        key("us-east-1a", "g5.xlarge"), key("us-east-1c", "g5.xlarge")}
    p4d = got[key("us-east-1a", "p4d.24xlarge")]
    assert p4d.targets == tuple(sorted((Target(a, 2, 2), Target(b, 3, 2))))
    assert p4d.capacity == 4 and p4d.owned_gpus == 5 * 8
    assert (p4d.availability, p4d.interruption_rate, p4d.quota_headroom,
            p4d.quota_group) == (1.0, None, None, None)
    assert p4d.price_per_hour == pytest.approx(0.25 * 8)
    assert p4d.price_per_gpu_hour == pytest.approx(0.25)
    # GPU facts from the same catalog as the type's other offers.
    od = next(o for o in offers if o.pool == key("us-east-1a", "p4d.24xlarge")._replace(
        market=Market.ON_DEMAND))
    assert (p4d.gpu, p4d.gpus, p4d.gpu_memory_gb, p4d.vcpus, p4d.memory_gb) == (
        od.gpu, od.gpus, od.gpu_memory_gb, od.vcpus, od.memory_gb) == (
        "A100-40GB", 8, 40.0, 96, 1152.0)
    assert got[key("us-east-1b", "p4d.24xlarge")].targets == (Target(c, 1, 1),)
    assert got[key("us-east-1a", "g5.xlarge")].targets == (Target(g, 4, 4),)
    assert {t.id for t in got[key("us-east-1c", "g5.xlarge")].targets} == set(extra)
    assert got[key("us-east-1a", "g5.xlarge")].price_per_hour == pytest.approx(0.25)
    assert fake_aws.call_count(action="DescribeCapacityReservations") == 2  # two pages
    assert p4d.to_json()["market"] == "reserved" and p4d.to_json()["owned_gpus"] == 40


async def test_free_counts_are_read_again_every_poll(fake_aws: FakeAWS,
                                                     adapter: AwsAdapter) -> None:
    rid = create(fake_aws, "us-east-1a", "p4d.24xlarge", 2)
    assert reserved(await adapter.poll(REGION))[key("us-east-1a", "p4d.24xlarge")
                                                ].capacity == 2
    fake_aws.use_capacity_reservation(rid, 2)  # a fully used reservation
    offer = reserved(await adapter.poll(REGION))[key("us-east-1a", "p4d.24xlarge")]
    assert offer.capacity == 0 and offer.targets == (Target(rid, 2, 0),)
    assert offer.availability == 1.0  # listed, never "no capacity at all"
    assert fake_aws.call_count(action="DescribeCapacityReservations") == 2


async def test_ended_cancelled_and_other_kinds_of_reservation_are_left_out(
        fake_aws: FakeAWS, adapter: AwsAdapter) -> None:
    keep = create(fake_aws, "us-east-1a", "p4d.24xlarge", 1)
    cancelled = create(fake_aws, "us-east-1a", "p4d.24xlarge", 1)
    fake_aws.client("ec2", REGION).cancel_capacity_reservation(
        CapacityReservationId=cancelled)
    past = fake_aws.now - timedelta(hours=1)
    fake_aws.add_capacity_reservation(REGION, "us-east-1a", "p4d.24xlarge", 1,
                                      end_date=past)  # expired: not listed as active
    # Listed as active all the same (a stale answer): its end date says it is over.
    stale = fake_aws.add_capacity_reservation(REGION, "us-east-1a", "p4d.24xlarge", 1,
                                              end_date=past, raw={"state": "active"})
    block = fake_aws.add_capacity_reservation(REGION, "us-east-1a", "p4d.24xlarge", 1,
                                              reservation_type="capacity-block")
    future = fake_aws.add_capacity_reservation(
        REGION, "us-east-1a", "p4d.24xlarge", 1, end_date=fake_aws.now + timedelta(days=1))
    with capture_logs() as logs:
        offer = reserved(await adapter.poll(REGION))[key("us-east-1a", "p4d.24xlarge")]
    assert {t.id for t in offer.targets} == {keep, future}
    skipped = {e["reservation"]: e["reason"] for e in logs
               if e["event"] == "aws capacity reservation skipped"}
    assert set(skipped) == {stale, block}
    assert "ended" in skipped[stale] and "Capacity Block" in skipped[block]


async def test_garbled_entries_are_skipped_one_by_one(fake_aws: FakeAWS,
                                                      adapter: AwsAdapter) -> None:
    good = create(fake_aws, "us-east-1a", "p4d.24xlarge", 2)
    bad = {
        "negative": {"totalInstanceCount": "-1"},
        "absurd": {"totalInstanceCount": "200000", "availableInstanceCount": "100"},
        "more free than total": {"availableInstanceCount": "9"},
        "no free count": {"availableInstanceCount": None},
        "no type": {"instanceType": None},
        "no zone": {"availabilityZone": None},
        "another region": {"availabilityZone": "us-west-2a"},
        "no id": {"capacityReservationId": None},
    }
    for raw in bad.values():
        fake_aws.add_capacity_reservation(REGION, "us-east-1a", "p4d.24xlarge", 2, raw=raw)
    not_gpu = fake_aws.add_capacity_reservation(REGION, "us-east-1a", "m5.large", 2)
    unknown = fake_aws.add_capacity_reservation(REGION, "us-east-1a", "x9.mega", 2)
    with capture_logs() as logs:
        offers = await adapter.poll(REGION)
    assert set(reserved(offers)) == {key("us-east-1a", "p4d.24xlarge")}
    assert reserved(offers)[key("us-east-1a", "p4d.24xlarge")].targets == (
        Target(good, 2, 2),)
    skipped = [e for e in logs if e["event"] == "aws capacity reservation skipped"]
    assert len(skipped) == len(bad) + 2
    assert {e["reservation"] for e in skipped} >= {not_gpu, unknown}
    assert all(e["log_level"] == "debug" for e in skipped)
    assert any(o.pool.market is Market.SPOT for o in offers)  # the rest of the region


async def test_off_means_no_call(fake_aws: FakeAWS) -> None:
    create(fake_aws, "us-east-1a", "p4d.24xlarge", 2)
    fake_aws.reset_calls()
    for a in (AwsAdapter(regions=[REGION], endpoint=fake_aws.url),  # the constructor's default
              from_config(AwsConfig(regions=[REGION], endpoint=fake_aws.url,
                                    reservations=ReservationsConfig(enabled=False)))):
        try:
            offers = await a.poll(REGION)
        finally:
            await a.close()
        assert offers and not reserved(offers)
    assert fake_aws.call_count(action="DescribeCapacityReservations") == 0


async def test_the_configuration_turns_them_on_with_its_price(fake_aws: FakeAWS) -> None:
    create(fake_aws, "us-east-1a", "g5.xlarge", 1)
    a = from_config(AwsConfig(regions=[REGION], endpoint=fake_aws.url,
                              reservations=ReservationsConfig(price_per_gpu_hour=0.4)))
    try:
        offer = reserved(await a.poll(REGION))[key("us-east-1a", "g5.xlarge")]
    finally:
        await a.close()
    assert offer.price_per_hour == pytest.approx(0.4)
    default = from_config(AwsConfig(regions=[REGION], endpoint=fake_aws.url))
    try:
        offer = reserved(await default.poll(REGION))[key("us-east-1a", "g5.xlarge")]
    finally:
        await default.close()
    assert offer.price_per_hour == 0.0  # on by default, already paid for


async def test_a_denied_permission_keeps_the_regions_offers_and_is_logged_once(
        fake_aws: FakeAWS, adapter: AwsAdapter) -> None:
    create(fake_aws, "us-east-1a", "p4d.24xlarge", 2)
    fake_aws.fail("DescribeCapacityReservations", code="UnauthorizedOperation", status=403,
                  times=None, message="You are not authorized to perform this operation.")
    with capture_logs() as logs:
        first = await adapter.poll(REGION)
        second = await adapter.poll(REGION)
    for offers in (first, second):
        assert not reserved(offers)
        assert any(o.pool.market is Market.SPOT and o.price_per_hour for o in offers)
        assert any(o.pool.market is Market.ON_DEMAND for o in offers)
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1 and warnings[0]["permission"] == PERMISSION
    assert warnings[0]["region"] == REGION
    assert fake_aws.call_count(action="DescribeCapacityReservations") == 2  # not retried
    fake_aws.clear_faults()
    with capture_logs() as logs:
        assert reserved(await adapter.poll(REGION))
    assert [e["event"] for e in logs if e["log_level"] == "info"] == [
        "aws partial poll recovered"]


async def test_a_failed_read_keeps_the_reservations_with_nothing_free(
        fake_aws: FakeAWS, adapter: AwsAdapter) -> None:
    rid = create(fake_aws, "us-east-1a", "p4d.24xlarge", 2)
    good = reserved(await adapter.poll(REGION))[key("us-east-1a", "p4d.24xlarge")]
    fake_aws.fail("DescribeCapacityReservations", code="InternalError", status=500,
                  times=None)
    offers = await adapter.poll(REGION)
    offer = reserved(offers)[key("us-east-1a", "p4d.24xlarge")]
    # Still listed (leases on it stay), nothing free (no new lease goes there).
    assert offer.targets == (Target(rid, 2, 0),) and offer.capacity == 0
    assert offer.observed_at == good.observed_at and offer.availability == 1.0
    assert fake_aws.call_count(action="DescribeCapacityReservations") > 2  # retried
    fake_aws.clear_faults()
    again = reserved(await adapter.poll(REGION))[key("us-east-1a", "p4d.24xlarge")]
    assert again.targets == (Target(rid, 2, 2),) and again.capacity == 2
