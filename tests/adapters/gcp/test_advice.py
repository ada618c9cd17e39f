"""Compute Engine's capacity advice in the GCP adapter: the real google-cloud-compute
`AdviceClient` (REST transport) against the fake Google Cloud's `advice.capacity`."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest
from factories import Clocks
from fake_gcp import FakeGCP, fake_gcp_fixture  # noqa: F401
from structlog.testing import capture_logs

from adapters.common import RetryPolicy
from adapters.gcp import advice
from adapters.gcp.adapter import GcpAdapter, Refresh
from broker.model import Market, Offer, PoolKey

REGION, ZONE = "us-central1", "us-central1-a"
OD, SPOT = Market.ON_DEMAND, Market.SPOT
A2 = "a2-highgpu-1g"
T4 = "n1-standard-8+nvidia-tesla-t4x1"


@pytest.fixture
def clocks() -> Clocks:
    return Clocks()


def by_key(offers: Iterable[Offer]) -> dict[PoolKey, Offer]:
    return {o.pool: o for o in offers}


def pool(itype: str, market: Market = OD, zone: str = ZONE) -> PoolKey:
    return PoolKey("gcp", REGION, zone, itype, market)


def make(fake: FakeGCP, clocks: Clocks, **kwargs: Any) -> GcpAdapter:
    opts: dict[str, Any] = {"project": fake.project, "endpoint": fake.url, "anonymous": True,
                            "retry": RetryPolicy(attempts=3, max_backoff=0.05),
                            "capacity_advice": True}
    opts.update(kwargs)
    return GcpAdapter(regions=[REGION], clock=lambda: clocks.now,
                      monotonic=lambda: clocks.mono, **opts)


@pytest.fixture
async def adapter(fake_gcp: FakeGCP, clocks: Clocks
                  ) -> AsyncIterator[GcpAdapter]:
    a = make(fake_gcp, clocks)
    yield a
    await a.close()


def listed(offers: list[Offer]) -> dict[PoolKey, Offer]:
    return {k: o for k, o in by_key(offers).items() if k.market in (OD, SPOT)}


async def test_obtainability_and_uptime_become_availability_and_hazard(
        fake_gcp: FakeGCP, adapter: GcpAdapter) -> None:
    fake_gcp.set_capacity_advice(ZONE, A2, "SPOT", obtainability=0.25, uptime_seconds=7200)
    fake_gcp.set_capacity_advice(ZONE, A2, "STANDARD", obtainability=0.9)
    fake_gcp.set_capacity_advice(ZONE, "n1-standard-8", "SPOT", obtainability=0.6,
                                 uptime_seconds=1800, accelerator="nvidia-tesla-t4")
    first = listed(await adapter.poll(REGION))
    # no poll waits for advice: the first lists none
    assert all(o.availability is None and o.interruption_rate is None
               for o in first.values())
    await adapter.refresh_advice(REGION)
    offers = listed(await adapter.poll(REGION))
    # one call per zone, shape and provisioning model: every pool asked about
    assert fake_gcp.call_count("advice.capacity") == len(offers)
    spot, od = offers[pool(A2, SPOT)], offers[pool(A2, OD)]
    assert spot.availability == 0.25
    assert spot.interruption_rate == pytest.approx(math.log(2) / 2, rel=1e-3)
    assert (od.availability, od.interruption_rate) == (0.9, None)
    t4 = offers[pool(T4, SPOT)]
    assert t4.availability == 0.6
    assert t4.interruption_rate == pytest.approx(2 * math.log(2), rel=1e-3)
    assert all(o.availability is not None for o in offers.values())
    assert all((o.interruption_rate is not None) == (o.pool.market is SPOT)
               for o in offers.values())


async def test_requests_are_the_documented_body(fake_gcp: FakeGCP,
                                                adapter: GcpAdapter) -> None:
    await adapter.poll(REGION)
    await adapter.refresh_advice(REGION)
    bodies = fake_gcp.advice_requests
    a2 = {"instanceProperties": {"scheduling": {"provisioningModel": "SPOT"}},
          "instanceFlexibilityPolicy": {"instanceSelections": {
              advice.SELECTION: {"machineTypes": [A2]}}},
          "size": 1, "distributionPolicy": {"zones": [{"zone": f"zones/{ZONE}"}],
                                            "targetShape": "ANY_SINGLE_ZONE"}}
    assert a2 in bodies
    t4 = {**a2, "instanceProperties": {"scheduling": {"provisioningModel": "STANDARD"}},
          "instanceFlexibilityPolicy": {"instanceSelections": {advice.SELECTION: {
              "machineTypes": ["n1-standard-8"],
              "guestAccelerators": [{"acceleratorType": "nvidia-tesla-t4",
                                     "acceleratorCount": 1}]}}}}
    assert t4 in bodies


async def test_a_refusal_is_remembered_and_logged_once(fake_gcp: FakeGCP, clocks: Clocks,
                                                       adapter: GcpAdapter) -> None:
    fake_gcp.advice_denied = True
    await adapter.poll(REGION)
    with capture_logs() as logs:
        await adapter.refresh_advice(REGION)
        await adapter.refresh_advice(REGION)
        clocks.advance(3600)
        offers = listed(await adapter.poll(REGION))
        await adapter.refresh_advice(REGION)
    # the first call alone, refused with 403 (not retried); then none for a while
    assert fake_gcp.call_count("advice.capacity") == 1
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1 and warnings[0]["permission"] == "compute.advice.capacity"
    assert warnings[0]["error"] == "AuthFailed"
    assert all(o.availability is None for o in offers.values())
    # stock-outs are still learnt
    adapter.note_stockout(pool(A2, SPOT))
    assert listed(await adapter.poll(REGION))[pool(A2, SPOT)].availability == 0.0
    # after `advice_denied`, one call again; granted now, advice is read
    fake_gcp.advice_denied = False
    clocks.advance(Refresh().advice_denied)
    with capture_logs() as logs:
        await adapter.refresh_advice(REGION)
    assert any(e["event"] == "gcp capacity advice available again" for e in logs)
    offers = listed(await adapter.poll(REGION))
    assert fake_gcp.call_count("advice.capacity") == 1 + len(offers)
    assert offers[pool(A2, OD)].availability is not None


async def test_a_shape_refused_alone_leaves_the_others_advised(fake_gcp: FakeGCP,
                                                               adapter: GcpAdapter) -> None:
    """A 400 for one machine type is that shape's refusal, not the project's: the other
    pools keep their advice, nothing is logged as a refusal, the next read asks again."""
    fake_gcp.advice_unsupported = {A2}
    fake_gcp.set_capacity_advice(ZONE, "n1-standard-8", "SPOT", obtainability=0.6,
                                 uptime_seconds=1800, accelerator="nvidia-tesla-t4")
    await adapter.poll(REGION)
    with capture_logs() as logs:
        await adapter.refresh_advice(REGION)
    offers = listed(await adapter.poll(REGION))
    assert not [e for e in logs if e["log_level"] == "warning"]
    assert offers[pool(A2, SPOT)].availability is None
    assert offers[pool(A2, OD)].availability is None
    assert offers[pool(T4, SPOT)].availability == 0.6
    asked = fake_gcp.call_count("advice.capacity")
    assert asked == len(offers)  # every pool was asked, the refused ones included
    await adapter.refresh_advice(REGION)
    assert fake_gcp.call_count("advice.capacity") == 2 * asked


async def test_a_failing_read_keeps_the_last_answers_for_a_while(
        fake_gcp: FakeGCP, clocks: Clocks, adapter: GcpAdapter) -> None:
    fake_gcp.set_capacity_advice(ZONE, A2, "SPOT", obtainability=0.5, uptime_seconds=3600)
    await adapter.poll(REGION)
    await adapter.refresh_advice(REGION)
    fake_gcp.reset_calls()
    fake_gcp.fail("advice.capacity", 503, times=None)
    clocks.advance(Refresh().advice + 1)
    with capture_logs() as logs:
        offers = listed(await adapter.poll(REGION))  # starts the read that is due
        await adapter.refresh_advice(REGION)  # waits for it
    # the first call failed after its retries: no other was made
    assert fake_gcp.call_count("advice.capacity") == 3
    assert offers[pool(A2, SPOT)].availability == 0.5
    assert [e["what"] for e in logs if e["log_level"] == "warning"] == ["capacity advice"]
    assert listed(await adapter.poll(REGION))[pool(A2, SPOT)].availability == 0.5
    clocks.advance(Refresh().advice_max_age)
    assert listed(await adapter.poll(REGION))[pool(A2, SPOT)].availability is None


async def test_a_stockout_and_advice_give_the_smaller_availability(
        fake_gcp: FakeGCP, clocks: Clocks, adapter: GcpAdapter) -> None:
    fake_gcp.set_capacity_advice(ZONE, A2, "SPOT", obtainability=0.8, uptime_seconds=3600)
    await adapter.poll(REGION)
    await adapter.refresh_advice(REGION)
    adapter.note_stockout(pool(A2, SPOT))
    assert listed(await adapter.poll(REGION))[pool(A2, SPOT)].availability == 0.0
    clocks.advance(600 + 1500)  # half recovered: 0.5 < 0.8
    assert listed(await adapter.poll(REGION))[pool(A2, SPOT)].availability == 0.5
    clocks.advance(1400)  # 0.9667 > 0.8
    assert listed(await adapter.poll(REGION))[pool(A2, SPOT)].availability == 0.8


async def test_garbled_scores_leave_that_pool_without_advice(fake_gcp: FakeGCP,
                                                             adapter: GcpAdapter) -> None:
    fake_gcp.set_capacity_advice(ZONE, A2, "SPOT", obtainability=1.7, uptime_seconds=3600)
    fake_gcp.set_capacity_advice(ZONE, A2, "STANDARD", obtainability=0.7)
    fake_gcp.set_capacity_advice(ZONE, "a2-highgpu-2g", "SPOT", obtainability=0.4,
                                 uptime_seconds="soon")
    await adapter.poll(REGION)
    await adapter.refresh_advice(REGION)
    offers = listed(await adapter.poll(REGION))
    assert offers[pool(A2, SPOT)].availability is None
    assert offers[pool("a2-highgpu-2g", SPOT)].availability is None
    assert offers[pool(A2, OD)].availability == 0.7


async def test_off_unless_asked_for(fake_gcp: FakeGCP, clocks: Clocks) -> None:
    a = make(fake_gcp, clocks, capacity_advice=False)
    try:
        await a.poll(REGION)
        await a.refresh_advice(REGION)
        assert fake_gcp.call_count("advice.capacity") == 0
    finally:
        await a.close()


@pytest.mark.parametrize(("value", "hours"), [
    ("3600s", 1.0), ("5400.5s", 5400.5 / 3600), (" 60s ", 1 / 60), ("0s", None),
    ("-5s", None), ("1h", None), (3600, None), (None, None)])
def test_duration_hours(value: object, hours: float | None) -> None:
    assert advice.duration_hours(value) == hours


def test_parse_reads_the_first_recommendation() -> None:
    answer = {"recommendations": [{"scores": {"obtainability": 0.3,
                                              "estimatedUptime": "7200s"}},
                                  {"scores": {"obtainability": 0.9}}]}
    assert advice.parse(answer, SPOT) == advice.Advice(0.3, 2.0)
    assert advice.parse(answer, OD) == advice.Advice(0.3, None)
    assert advice.parse({}, SPOT) is None
    assert advice.parse({"recommendations": [{"shards": []}]}, SPOT) is None
    for bad in ({"obtainability": -0.1}, {"obtainability": "high"},
                {"obtainability": True}, {"estimatedUptime": "never"}):
        with pytest.raises(ValueError):
            advice.parse({"recommendations": [{"scores": bad}]}, SPOT)
