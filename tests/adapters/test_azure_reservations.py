"""Azure capacity reservations offered in the `reserved` market: the Azure adapter with
the real azure-mgmt-compute client against the fake Azure endpoint, which answers the
capacity reservation group and capacity reservation calls in ARM's shapes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from factories import reserved
from fake_azure import FakeAzure, fake_azure_fixture  # noqa: F401
from structlog.testing import capture_logs

from adapters.azure.adapter import AzureAdapter, from_config
from broker.daemon.config import AzureConfig, ReservationsConfig
from broker.model import Market, PoolKey, Target

REGION = "eastus"
A100 = "Standard_NC24ads_A100_v4"
ND = "Standard_ND96asr_v4"
PERMISSION = "Microsoft.Compute/capacityReservationGroups/read"


def make(fake: FakeAzure, **kwargs: Any) -> AzureAdapter:
    kwargs.setdefault("reservations", True)
    return AzureAdapter(subscription_id=fake.subscription_id, endpoint=fake.url,
                        anonymous=True, regions=[REGION], max_backoff=0.05, **kwargs)


@pytest.fixture
async def adapter(fake_azure: FakeAzure) -> AsyncIterator[AzureAdapter]:
    a = make(fake_azure, reservation_price_per_gpu_hour=0.5)
    yield a
    await a.close()


def key(zone: str, size: str, market: Market = Market.RESERVED) -> PoolKey:
    return PoolKey("azure", REGION, zone, size, market)


async def test_reservations_become_reserved_offers_with_their_groups_as_targets(
        fake_azure: FakeAzure, adapter: AzureAdapter) -> None:
    train = fake_azure.add_capacity_reservation_group(REGION, "train", zones=["1", "2"])
    infer = fake_azure.add_capacity_reservation_group(REGION, "infer", zones=["1"],
                                                      resource_group="serving")
    fake_azure.add_capacity_reservation(train, "a100-z1", A100, 4, zone="1", allocated=1)
    fake_azure.add_capacity_reservation(train, "nd-z2", ND, 2, zone="2")
    fake_azure.add_capacity_reservation(train, "nd-z2-more", ND, 1, zone="2", allocated=1)
    fake_azure.add_capacity_reservation(infer, "a100", A100, 3, zone="1", allocated=5)
    partial = fake_azure.add_capacity_reservation_group(REGION, "partial")
    fake_azure.add_capacity_reservation(partial, "regional", A100, 6, current_capacity=2)
    west = fake_azure.add_capacity_reservation_group("westus", "west")
    fake_azure.add_capacity_reservation(west, "a100", A100, 9)

    offers = await adapter.poll(REGION)
    got = reserved(offers)
    assert set(got) == {key("eastus-1", A100), key("eastus-2", ND), key(REGION, A100)}
    a100 = got[key("eastus-1", A100)]
    # A VM is launched with its group: the targets are the groups' resource ids.
    assert a100.targets == tuple(sorted((Target(train, 4, 3), Target(infer, 3, 0))))
    assert a100.capacity == 3 and a100.owned_gpus == 7  # the overallocated one: 0 free
    assert (a100.availability, a100.interruption_rate, a100.quota_headroom,
            a100.quota_group) == (1.0, None, None, None)
    assert a100.price_per_hour == pytest.approx(0.5)
    od = {o.pool: o for o in offers}[key("eastus-1", A100, Market.ON_DEMAND)]
    assert (a100.gpu, a100.gpus, a100.gpu_memory_gb, a100.vcpus, a100.memory_gb,
            a100.gpu_known) == (od.gpu, od.gpus, od.gpu_memory_gb, od.vcpus, od.memory_gb,
                                od.gpu_known) == ("A100-80GB", 1, 80, 24, 220.0, True)
    nd = got[key("eastus-2", ND)]
    assert nd.targets == (Target(train, 3, 2),) and nd.gpus == 8  # one group: one target
    assert nd.price_per_hour == pytest.approx(4.0)
    # A regional reservation's pool is the region; what is reserved now is its size.
    assert got[key(REGION, A100)].targets == (Target(partial, 2, 2),)
    # Four groups in pages of two; then each eastus group's view and reservations.
    assert fake_azure.call_count("reservation_groups") == 2
    assert fake_azure.call_count("reservation_group") == 3
    assert fake_azure.call_count("reservations") == 4


async def test_free_counts_are_read_again_every_poll(fake_azure: FakeAzure,
                                                     adapter: AzureAdapter) -> None:
    group = fake_azure.add_capacity_reservation_group(REGION, "g")
    fake_azure.add_capacity_reservation(group, "r", A100, 2, zone="3")
    assert reserved(await adapter.poll(REGION))[key("eastus-3", A100)].capacity == 2
    fake_azure.allocate(group, "r", 2)  # fully used
    offer = reserved(await adapter.poll(REGION))[key("eastus-3", A100)]
    assert offer.targets == (Target(group, 2, 0),) and offer.capacity == 0
    assert offer.availability == 1.0
    fake_azure.remove_capacity_reservation_group(group)  # deleted: the pool goes
    assert not reserved(await adapter.poll(REGION))
    assert fake_azure.call_count("reservation_groups") == 3


async def test_unprovisioned_future_and_block_reservations_are_left_out(
        fake_azure: FakeAzure, adapter: AzureAdapter) -> None:
    group = fake_azure.add_capacity_reservation_group(REGION, "g")
    block = fake_azure.add_capacity_reservation_group(REGION, "block",
                                                      reservation_type="Block")
    fake_azure.add_capacity_reservation(block, "week", A100, 4, zone="1")
    fake_azure.add_capacity_reservation(group, "ok", A100, 1, zone="1")
    fake_azure.add_capacity_reservation(group, "resizing", A100, 1, zone="1",
                                        provisioning_state="Updating")
    fake_azure.add_capacity_reservation(group, "live", A100, 1, zone="1",
                                        reservation_state="Live")
    skipped = {"creating": dict(provisioning_state="Creating"),
               "deleting": dict(provisioning_state="Deleting"),
               "failed": dict(provisioning_state="Failed"),
               "pending": dict(reservation_state="Pending")}
    for name, kw in skipped.items():
        fake_azure.add_capacity_reservation(group, name, ND, 1, zone="2", **kw)
    with capture_logs() as logs:
        got = reserved(await adapter.poll(REGION))
    assert set(got) == {key("eastus-1", A100)}
    assert got[key("eastus-1", A100)].targets == (Target(group, 3, 3),)  # one group
    why = {e["reservation"]: e["reason"] for e in logs
           if e["event"] == "azure capacity reservation skipped"}
    assert set(why) == set(skipped) and "future" in why["pending"]
    groups = [e for e in logs if e["event"] == "azure capacity reservation group skipped"]
    assert [e["group"] for e in groups] == [block] and "Block" in groups[0]["reason"]


async def test_garbled_entries_are_skipped_one_by_one(fake_azure: FakeAzure,
                                                      adapter: AzureAdapter) -> None:
    group = fake_azure.add_capacity_reservation_group(REGION, "g")
    fake_azure.add_capacity_reservation(group, "good", A100, 2, zone="1")
    bad: dict[str, dict[str, Any]] = {
        "no-capacity": {"raw": {"sku.capacity": None}},
        "negative": {"raw": {"sku.capacity": -1}},
        "absurd": {"raw": {"sku.capacity": 200_000}},
        "text": {"raw": {"sku.capacity": "four"}},
        "no-size": {"raw": {"sku.name": None}},
        "two-zones": {"raw": {"zones": ["1", "2"]}},
        "elsewhere": {"raw": {"location": "westus"}},
        "no-state": {"raw": {"properties.provisioningState": None}},
        "no-view": {"view": False},
    }
    for name, kw in bad.items():
        fake_azure.add_capacity_reservation(group, name, A100, 2, zone="1", **kw)
    fake_azure.add_capacity_reservation(group, "no-gpu", "Standard_D4s_v5", 2, zone="1")
    fake_azure.add_capacity_reservation(group, "fraction", "Standard_NV6ads_A10_v5", 2,
                                        zone="1")
    fake_azure.add_capacity_reservation(group, "unknown", "Standard_X9_v9", 2, zone="1")
    with capture_logs() as logs:
        offers = await adapter.poll(REGION)
    assert set(reserved(offers)) == {key("eastus-1", A100)}
    assert reserved(offers)[key("eastus-1", A100)].targets == (Target(group, 2, 2),)
    skipped = [e for e in logs if e["event"] == "azure capacity reservation skipped"]
    assert {e["reservation"] for e in skipped} == set(bad) | {"no-gpu", "fraction",
                                                              "unknown"}
    assert all(e["log_level"] == "debug" for e in skipped)
    assert any(o.pool.market is Market.SPOT for o in offers)  # the rest of the region


async def test_a_group_deleted_while_read_is_left_out(fake_azure: FakeAzure,
                                                      adapter: AzureAdapter) -> None:
    for name in ("a", "b"):
        group = fake_azure.add_capacity_reservation_group(REGION, name)
        fake_azure.add_capacity_reservation(group, "r", A100, 1, zone="1")
    fake_azure.fail("reservation_group", status=404, code="ResourceNotFound", times=1)
    offer = reserved(await adapter.poll(REGION))[key("eastus-1", A100)]
    assert len(offer.targets) == 1  # the other group's, and no failed read
    assert len(reserved(await adapter.poll(REGION))[key("eastus-1", A100)].targets) == 2


async def test_off_means_no_call(fake_azure: FakeAzure) -> None:
    group = fake_azure.add_capacity_reservation_group(REGION, "g")
    fake_azure.add_capacity_reservation(group, "r", A100, 2, zone="1")
    for a in (AzureAdapter(subscription_id=fake_azure.subscription_id, regions=[REGION],
                           endpoint=fake_azure.url, anonymous=True),  # the default: off
              from_config(AzureConfig(subscription_id=fake_azure.subscription_id,
                                      regions=[REGION], endpoint=fake_azure.url,
                                      anonymous=True,
                                      reservations=ReservationsConfig(enabled=False)))):
        try:
            offers = await a.poll(REGION)
        finally:
            await a.close()
        assert offers and not reserved(offers)
    assert sum(fake_azure.call_count(api) for api in (
        "reservation_groups", "reservation_group", "reservations", "reservation")) == 0


async def test_the_configuration_turns_them_on_with_its_price(fake_azure: FakeAzure) -> None:
    group = fake_azure.add_capacity_reservation_group(REGION, "g")
    fake_azure.add_capacity_reservation(group, "r", ND, 1, zone="1")
    for cfg, price in ((ReservationsConfig(price_per_gpu_hour=0.25), 2.0),
                       (ReservationsConfig(), 0.0)):
        a = from_config(AzureConfig(subscription_id=fake_azure.subscription_id,
                                    regions=[REGION], endpoint=fake_azure.url,
                                    anonymous=True, reservations=cfg))
        try:
            offer = reserved(await a.poll(REGION))[key("eastus-1", ND)]
        finally:
            await a.close()
        assert offer.price_per_hour == pytest.approx(price)


async def test_a_denied_permission_keeps_the_regions_offers_and_is_logged_once(
        fake_azure: FakeAzure, adapter: AzureAdapter) -> None:
    group = fake_azure.add_capacity_reservation_group(REGION, "g")
    fake_azure.add_capacity_reservation(group, "r", A100, 2, zone="1")
    fake_azure.fail("reservation_groups", status=403, code="AuthorizationFailed", times=None,
                    message="The client does not have authorization to perform action "
                            f"'{PERMISSION}'")
    with capture_logs() as logs:
        first = await adapter.poll(REGION)
        second = await adapter.poll(REGION)
    for offers in (first, second):
        assert not reserved(offers)
        assert any(o.pool.market is Market.ON_DEMAND and o.price_per_hour for o in offers)
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1
    assert (warnings[0]["permission"], warnings[0]["region"]) == (PERMISSION, REGION)
    assert fake_azure.call_count("reservation_groups") == 2  # not retried
    fake_azure.clear_faults()
    with capture_logs() as logs:
        assert reserved(await adapter.poll(REGION))
    assert [e["event"] for e in logs if e["log_level"] == "info"] == [
        "azure partial poll recovered"]


async def test_a_failed_read_keeps_the_reservations_with_nothing_free(
        fake_azure: FakeAzure, adapter: AzureAdapter) -> None:
    group = fake_azure.add_capacity_reservation_group(REGION, "g")
    fake_azure.add_capacity_reservation(group, "r", A100, 2, zone="1")
    assert reserved(await adapter.poll(REGION))
    fake_azure.fail("reservations", status=503, times=None)  # one of a group's calls
    offer = reserved(await adapter.poll(REGION))[key("eastus-1", A100)]
    assert offer.targets == (Target(group, 2, 0),) and offer.capacity == 0
    assert fake_azure.call_count("reservations") > 2  # retried, then given up on
    fake_azure.clear_faults()
    offer = reserved(await adapter.poll(REGION))[key("eastus-1", A100)]
    assert offer.targets == (Target(group, 2, 2),)
