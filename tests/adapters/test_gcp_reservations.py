"""GCP reservations offered in the `reserved` market: the GCP adapter with the real
google-cloud-compute client (REST transport) against the fake Google Cloud endpoint,
which answers `reservations.aggregatedList` in the v1 REST shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from factories import reserved
from fake_gcp import FakeGCP, fake_gcp_fixture  # noqa: F401
from structlog.testing import capture_logs

from adapters.common import RetryPolicy
from adapters.gcp.adapter import GcpAdapter, from_config
from broker.daemon.config import GcpConfig, ReservationsConfig
from broker.model import Market, PoolKey, Target

REGION = "us-central1"
NOW = datetime(2026, 11, 30, 12, tzinfo=UTC)
T4 = "nvidia-tesla-t4"
OP = "reservations.aggregatedList"


class Clock:
    def __init__(self) -> None:
        self.mono = 1000.0

    def tick(self) -> float:
        self.mono += 1.0
        return self.mono


def make(fake: FakeGCP, **kwargs: Any) -> GcpAdapter:
    kwargs.setdefault("reservations", True)
    clock = Clock()
    return GcpAdapter(regions=[REGION], project=fake.project, endpoint=fake.url,
                      anonymous=True, retry=RetryPolicy(max_backoff=0.05),
                      clock=lambda: NOW, monotonic=clock.tick, **kwargs)


@pytest.fixture
async def adapter(fake_gcp: FakeGCP) -> AsyncIterator[GcpAdapter]:
    a = make(fake_gcp, reservation_price_per_gpu_hour=0.5)
    yield a
    await a.close()


def key(zone: str, itype: str, market: Market = Market.RESERVED) -> PoolKey:
    return PoolKey("gcp", REGION, zone, itype, market)


async def test_reservations_become_reserved_offers_grouped_by_zone_and_shape(
        fake_gcp: FakeGCP, adapter: GcpAdapter) -> None:
    fake_gcp.add_reservation("us-central1-a", "train-b", "a2-highgpu-1g", 3, specific=False)
    fake_gcp.add_reservation("us-central1-a", "train-a", "a2-highgpu-1g", 2, in_use=1)
    fake_gcp.add_reservation("us-central1-b", "t4s", "n1-standard-8", 4, in_use=1,
                             accelerators=((T4, 1),))
    fake_gcp.add_reservation("us-central1-b", "t4-highmem", "n1-highmem-8", 2,
                             accelerators=((T4, 2),))
    fake_gcp.add_reservation("us-central1-c", "l4s", "g2-standard-8", 1,
                             accelerators=(("nvidia-l4", 1),))  # as listed with the type
    fake_gcp.add_reservation("europe-west4-a", "elsewhere", "a2-highgpu-1g", 5)

    offers = await adapter.poll(REGION)
    got = reserved(offers)
    assert set(got) == {key("us-central1-a", "a2-highgpu-1g"),
                        key("us-central1-b", "n1-standard-8+nvidia-tesla-t4x1"),
                        key("us-central1-b", "n1-highmem-8+nvidia-tesla-t4x2"),
                        key("us-central1-c", "g2-standard-8")}
    a2 = got[key("us-central1-a", "a2-highgpu-1g")]
    assert a2.targets == (Target("train-a", 2, 1), Target("train-b", 3, 3))
    assert a2.capacity == 4 and a2.owned_gpus == 5
    assert (a2.availability, a2.interruption_rate, a2.quota_headroom, a2.quota_group) == (
        1.0, None, None, None)
    assert a2.price_per_hour == pytest.approx(0.5) and a2.observed_at == NOW
    od = {o.pool: o for o in offers}[key("us-central1-a", "a2-highgpu-1g", Market.ON_DEMAND)]
    assert (a2.gpu, a2.gpus, a2.gpu_memory_gb, a2.vcpus, a2.memory_gb, a2.gpu_known) == (
        od.gpu, od.gpus, od.gpu_memory_gb, od.vcpus, od.memory_gb, od.gpu_known) == (
        "A100-40GB", 1, 40, 12, 85.0, True)
    # An N1 + GPU reservation is named as the N1 + GPU offers are, with their facts ...
    t4 = got[key("us-central1-b", "n1-standard-8+nvidia-tesla-t4x1")]
    assert t4.targets == (Target("t4s", 4, 3),)
    assert (t4.gpu, t4.gpus, t4.vcpus) == ("T4", 1, 8)
    # ... and a host the offers do not use keeps its GPU facts, vCPUs unknown.
    highmem = got[key("us-central1-b", "n1-highmem-8+nvidia-tesla-t4x2")]
    assert (highmem.gpu, highmem.gpus, highmem.vcpus, highmem.memory_gb) == ("T4", 2, None,
                                                                             None)
    assert highmem.price_per_hour == pytest.approx(1.0)
    assert got[key("us-central1-c", "g2-standard-8")].gpu == "L4"
    assert fake_gcp.call_count(OP) == 2  # three reservations a page


async def test_free_counts_are_read_again_every_poll(fake_gcp: FakeGCP,
                                                     adapter: GcpAdapter) -> None:
    fake_gcp.add_reservation("us-central1-a", "r", "a2-highgpu-1g", 2)
    assert reserved(await adapter.poll(REGION))[key("us-central1-a", "a2-highgpu-1g")
                                                ].capacity == 2
    fake_gcp.set_reservation_in_use("us-central1-a", "r", 2)  # fully used
    offer = reserved(await adapter.poll(REGION))[key("us-central1-a", "a2-highgpu-1g")]
    assert offer.targets == (Target("r", 2, 0),) and offer.capacity == 0
    assert offer.availability == 1.0
    fake_gcp.remove_reservation("us-central1-a", "r")  # deleted: the pool goes
    assert not reserved(await adapter.poll(REGION))
    assert fake_gcp.call_count(OP) == 3


async def test_reservations_not_ready_deleted_or_from_templates_are_left_out(
        fake_gcp: FakeGCP, adapter: GcpAdapter) -> None:
    zone = "us-central1-a"
    fake_gcp.add_reservation(zone, "ready", "a2-highgpu-1g", 1)
    fake_gcp.add_reservation(zone, "resizing", "a2-highgpu-1g", 1, status="UPDATING")
    fake_gcp.add_reservation(zone, "later", "a2-highgpu-1g", 1,
                             delete_at=(NOW + timedelta(days=1)).isoformat())
    skipped = {
        "creating": dict(status="CREATING"),
        "deleting": dict(status="DELETING"),
        "expired": dict(delete_at="2026-11-30T11:00:00Z"),
        "templated": dict(template="gpu-template"),
    }
    for name, kw in skipped.items():
        fake_gcp.add_reservation(zone, name, "a2-highgpu-1g", 1, **kw)
    with capture_logs() as logs:
        offer = reserved(await adapter.poll(REGION))[key(zone, "a2-highgpu-1g")]
    assert {t.id for t in offer.targets} == {"ready", "resizing", "later"}
    why = {e["reservation"]: e["reason"] for e in logs
           if e["event"] == "gcp reservation skipped"}
    assert set(why) == set(skipped)
    assert "template" in why["templated"] and "deleted" in why["expired"]


async def test_garbled_entries_are_skipped_one_by_one(fake_gcp: FakeGCP,
                                                      adapter: GcpAdapter) -> None:
    zone = "us-central1-a"
    fake_gcp.add_reservation(zone, "good", "a2-highgpu-1g", 2, in_use=1)
    bad: dict[str, dict[str, Any]] = {
        "no-count": {"raw": {"specificReservation.count": None}},
        "negative": {"raw": {"specificReservation.count": "-1"}},
        "absurd": {"raw": {"specificReservation.count": "200000"}},
        "overused": {"in_use": 3},
        "no-machine": {"raw": {"specificReservation.instanceProperties.machineType": None}},
        "no-zone": {"raw": {"zone": None}},
        "no-status": {"raw": {"status": None}},
        "zero-gpus": {"accelerators": ((T4, 0),)},
    }
    for name, kw in bad.items():
        fake_gcp.add_reservation(zone, name, "a2-highgpu-1g", 2, **kw)
    fake_gcp.add_reservation(zone, "no-gpu", "n2-standard-8", 2)
    fake_gcp.add_reservation(zone, "unknown", "a9-hypergpu-1g", 2)
    fake_gcp.add_reservation(zone, "k80", "n1-standard-8", 2,
                             accelerators=(("nvidia-tesla-k80", 1),))
    fake_gcp.add_reservation(zone, "two-kinds", "n1-standard-8", 2,
                             accelerators=((T4, 1), ("nvidia-tesla-p4", 1)))
    with capture_logs() as logs:
        offers = await adapter.poll(REGION)
    assert reserved(offers) == {key(zone, "a2-highgpu-1g"): reserved(offers)[
        key(zone, "a2-highgpu-1g")]}
    assert reserved(offers)[key(zone, "a2-highgpu-1g")].targets == (Target("good", 2, 1),)
    skipped = {e["reservation"] for e in logs if e["event"] == "gcp reservation skipped"}
    assert skipped == set(bad) | {"no-gpu", "unknown", "k80", "two-kinds"}
    assert all(e["log_level"] == "debug" for e in logs
               if e["event"] == "gcp reservation skipped")
    assert any(o.pool.market is Market.SPOT for o in offers)  # the rest of the region


async def test_off_means_no_call(fake_gcp: FakeGCP) -> None:
    fake_gcp.add_reservation("us-central1-a", "r", "a2-highgpu-1g", 2)
    for a in (make(fake_gcp, reservations=False),
              from_config(GcpConfig(project=fake_gcp.project, regions=[REGION],
                                    endpoint=fake_gcp.url, anonymous=True,
                                    reservations=ReservationsConfig(enabled=False)))):
        try:
            offers = await a.poll(REGION)
        finally:
            await a.close()
        assert offers and not reserved(offers)
    assert fake_gcp.call_count(OP) == 0 and fake_gcp.call_count("reservations.list") == 0
    default = GcpAdapter(regions=[REGION], project=fake_gcp.project, endpoint=fake_gcp.url,
                         anonymous=True)  # the constructor's default: off
    try:
        assert not reserved(await default.poll(REGION))
    finally:
        await default.close()
    assert fake_gcp.call_count(OP) == 0


async def test_the_configuration_turns_them_on_with_its_price(fake_gcp: FakeGCP) -> None:
    fake_gcp.add_reservation("us-central1-b", "t4s", "n1-standard-16", 1,
                             accelerators=((T4, 2),))
    for cfg, price in ((ReservationsConfig(price_per_gpu_hour=0.3), 0.6),
                       (ReservationsConfig(), 0.0)):
        a = from_config(GcpConfig(project=fake_gcp.project, regions=[REGION],
                                  endpoint=fake_gcp.url, anonymous=True, reservations=cfg))
        try:
            offers = reserved(await a.poll(REGION))
        finally:
            await a.close()
        offer = offers[key("us-central1-b", "n1-standard-16+nvidia-tesla-t4x2")]
        assert offer.price_per_hour == pytest.approx(price)


async def test_a_denied_permission_keeps_the_regions_offers_and_is_logged_once(
        fake_gcp: FakeGCP, adapter: GcpAdapter) -> None:
    fake_gcp.add_reservation("us-central1-a", "r", "a2-highgpu-1g", 2)
    fake_gcp.fail(OP, status=403, times=None, reason="forbidden",
                  message="Required 'compute.reservations.list' permission for "
                          "'projects/gpubroker-test'")
    with capture_logs() as logs:
        first = await adapter.poll(REGION)
        second = await adapter.poll(REGION)
    for offers in (first, second):
        assert not reserved(offers)
        assert any(o.pool.market is Market.ON_DEMAND and o.price_per_hour for o in offers)
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1
    assert (warnings[0]["permission"], warnings[0]["region"]) == (
        "compute.reservations.list", REGION)
    assert fake_gcp.call_count(OP) == 2  # not retried
    fake_gcp.clear_faults()
    with capture_logs() as logs:
        assert reserved(await adapter.poll(REGION))
    assert [e["event"] for e in logs if e["log_level"] == "info"] == [
        "gcp partial poll recovered"]


async def test_a_failed_read_keeps_the_reservations_with_nothing_free(
        fake_gcp: FakeGCP, adapter: GcpAdapter) -> None:
    fake_gcp.add_reservation("us-central1-a", "r", "a2-highgpu-1g", 2)
    assert reserved(await adapter.poll(REGION))
    fake_gcp.fail(OP, status=503, times=None)
    offer = reserved(await adapter.poll(REGION))[key("us-central1-a", "a2-highgpu-1g")]
    assert offer.targets == (Target("r", 2, 0),) and offer.capacity == 0
    assert fake_gcp.call_count(OP) > 2  # retried, then given up on for this poll
    fake_gcp.clear_faults()
    offer = reserved(await adapter.poll(REGION))[key("us-central1-a", "a2-highgpu-1g")]
    assert offer.targets == (Target("r", 2, 2),)
