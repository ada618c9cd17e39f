"""Tests of the fake Azure endpoint (`tests/fakes/fake_azure.py`) with a plain HTTP client: the
shapes and the refusals a client relies on, and its random faults."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from fake_azure import SUBSCRIPTION_ID, FakeAzure, fake_azure_fixture  # noqa: F401
from fake_server import Chaos

SKUS = f"/subscriptions/{SUBSCRIPTION_ID}/providers/Microsoft.Compute/skus"


async def get(url: str, **params: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.get(url, params=params) as resp:
        return resp.status, await resp.json()


async def test_arm_refusals_use_arms_error_shape(fake_azure: FakeAzure) -> None:
    status, body = await get(f"{fake_azure.url}/subscriptions/nope/providers/"
                             "Microsoft.Compute/skus", **{"api-version": "2021-07-01"})
    assert (status, body["error"]["code"]) == (404, "SubscriptionNotFound")
    status, body = await get(fake_azure.url + SKUS)
    assert (status, body["error"]["code"]) == (400, "MissingApiVersionParameter")
    status, body = await get(fake_azure.url + SKUS, **{"api-version": "2021-07-01",
                                                       "$filter": "name eq 'x'"})
    assert (status, body["error"]["code"]) == (400, "InvalidFilter")


async def test_skus_without_a_filter_list_every_region(fake_azure: FakeAzure) -> None:
    fake_azure.page_size["skus"] = 10_000
    status, body = await get(fake_azure.url + SKUS, **{"api-version": "2021-07-01"})
    assert status == 200 and "nextLink" not in body
    assert {s["locations"][0] for s in body["value"]} == set(fake_azure.regions)


async def test_retail_filter_subset(fake_azure: FakeAzure) -> None:
    url = fake_azure.url + "/api/retail/prices"
    status, body = await get(url, **{"$filter": "armRegionName eq 'westus' and "
                                                "contains(meterName, 'Spot') and "
                                                "priceType eq 'Consumption'"})
    assert status == 200 and body["Items"]
    assert all(i["meterName"].endswith("Spot") and i["armRegionName"] == "westus"
               for i in body["Items"])
    assert body["Count"] == len(body["Items"])
    status, body = await get(url, **{"$filter": "armRegionName ne 'westus'"})
    assert status == 400


async def test_faults_count_down_and_carry_retry_after(fake_azure: FakeAzure) -> None:
    url = fake_azure.url + "/api/retail/prices"
    fake_azure.fail("prices", status=429, times=2, retry_after=3)
    async with aiohttp.ClientSession() as http:
        seen = []
        for _ in range(3):
            async with http.get(url) as resp:
                seen.append((resp.status, resp.headers.get("Retry-After")))
    assert seen == [(429, "3"), (429, "3"), (200, None)]
    assert fake_azure.call_count("prices") == 3
    with pytest.raises(ValueError, match="unknown api"):
        fake_azure.fail("compute")


# --- random faults ----------------------------------------------------------------------

GRAPH_QUERY = {"query": "SpotResources | where type =~ "
                        "'microsoft.compute/skuspotevictionrate/location'"}


async def send(http: aiohttp.ClientSession, method: str, url: str, **kw: Any
               ) -> tuple[int, dict[str, str], str]:
    async with http.request(method, url, **kw) as resp:
        return resp.status, dict(resp.headers), await resp.text()


async def test_random_throttles_answer_as_each_service_does(fake_azure: FakeAzure) -> None:
    fake_azure.chaos = Chaos(rate=1.0, kinds=("throttle",), seed=3)
    skus = fake_azure.url + SKUS + "?api-version=2021-07-01"
    async with aiohttp.ClientSession() as http:
        codes = set()
        for _ in range(12):
            status, headers, text = await send(http, "GET", skus)
            assert (status, headers["Retry-After"]) == (429, "1")
            body = json.loads(text)
            if "error" in body:  # ARM's own limit
                codes.add(body["error"]["code"])
                assert headers["x-ms-ratelimit-remaining-subscription-reads"] == "0"
            else:  # the Compute resource provider's, unwrapped
                codes.add(body["code"])
                assert body["details"][0]["code"] == "TooManyRequests"
        assert codes == {"TooManyRequests", "OperationNotAllowed"}
        status, headers, text = await send(
            http, "POST", fake_azure.url + "/providers/Microsoft.ResourceGraph/resources"
            "?api-version=2021-03-01", json=GRAPH_QUERY)
        assert (status, json.loads(text)["error"]["code"]) == (429, "RateLimiting")
        assert headers["x-ms-user-quota-resets-after"] == "00:00:01"
        assert "Retry-After" not in headers
        status, headers, text = await send(http, "GET", fake_azure.url + "/api/retail/prices")
        assert (status, headers["Retry-After"], text) == (429, "1", "Too Many Requests")
    assert fake_azure.faulted == {"throttle": 14}
    assert fake_azure.call_count() == 0  # no answer came from the handlers


async def test_random_server_errors_answer_as_each_service_does(fake_azure: FakeAzure
                                                                ) -> None:
    fake_azure.chaos = Chaos(rate=1.0, kinds=("5xx",), seed=3)
    async with aiohttp.ClientSession() as http:
        status, _, text = await send(http, "GET", fake_azure.url + SKUS)
        assert status in (500, 503)
        assert json.loads(text)["error"]["code"] in ("InternalServerError",
                                                     "ServiceUnavailable")
        status, _, text = await send(http, "GET", fake_azure.url + "/api/retail/prices")
        assert status in (500, 503) and text == f"{status} Server Error"


async def test_chaos_repeats_spares_a_request_sent_that_often(fake_azure: FakeAzure) -> None:
    fake_azure.chaos = Chaos(rate=1.0, kinds=("truncated",))
    fake_azure.chaos_repeats = 2
    url = fake_azure.url + "/api/retail/prices"
    async with aiohttp.ClientSession() as http:
        bodies = [(await send(http, "GET", url))[2] for _ in range(3)]
        other = (await send(http, "GET", url + "?$skip=50"))[2]
    assert [len(b) for b in bodies[:2]] == [len(bodies[2]) // 2] * 2
    json.loads(bodies[2])  # whole
    with pytest.raises(ValueError):
        json.loads(other)  # another request: faulted again
    assert fake_azure.faulted == {"truncated": 3}


async def test_capacity_reservations_answer_in_arms_shapes(fake_azure: FakeAzure) -> None:
    api = {"api-version": "2024-11-01"}
    group = fake_azure.add_capacity_reservation_group("eastus", "train", zones=["1", "2"])
    fake_azure.add_capacity_reservation(group, "a100", "Standard_NC24ads_A100_v4", 4,
                                        zone="1", allocated=1)
    fake_azure.add_capacity_reservation(group, "nd", "Standard_ND96asr_v4", 2, zone="2",
                                        view=False)
    other = fake_azure.add_capacity_reservation_group("westus", "other",
                                                      resource_group="elsewhere")
    base = fake_azure.url + f"/subscriptions/{SUBSCRIPTION_ID}"
    status, body = await get(f"{base}/providers/Microsoft.Compute/capacityReservationGroups",
                             **api)
    assert status == 200 and [g["id"] for g in body["value"]] == [group, other]
    listed = body["value"][0]
    assert (listed["type"], listed["location"], listed["zones"]) == (
        "Microsoft.Compute/capacityReservationGroups", "eastus", ["1", "2"])
    assert [r["id"] for r in listed["properties"]["capacityReservations"]] == [
        f"{group}/capacityReservations/a100", f"{group}/capacityReservations/nd"]
    assert "instanceView" not in listed["properties"]
    status, body = await get(f"{base}/resourceGroups/elsewhere/providers/Microsoft.Compute/"
                             "capacityReservationGroups", **api)
    assert [g["id"] for g in body["value"]] == [other]
    status, body = await get(fake_azure.url + group, **api, **{"$expand": "instanceView"})
    views = body["properties"]["instanceView"]["capacityReservations"]
    assert [v["name"] for v in views] == ["a100"]  # `view=False` left nd out
    assert views[0]["utilizationInfo"]["currentCapacity"] == 4
    assert len(views[0]["utilizationInfo"]["virtualMachinesAllocated"]) == 1
    status, body = await get(f"{fake_azure.url}{group}/capacityReservations", **api)
    a100 = body["value"][0]
    assert (a100["type"], a100["sku"], a100["zones"], a100["properties"]["provisioningState"]
            ) == ("Microsoft.Compute/capacityReservationGroups/capacityReservations",
                  {"name": "Standard_NC24ads_A100_v4", "capacity": 4}, ["1"], "Succeeded")
    assert "instanceView" not in a100["properties"] and "nextLink" not in body  # one page
    status, body = await get(f"{fake_azure.url}{group}/capacityReservations/a100", **api,
                             **{"$expand": "instanceView"})
    assert body["properties"]["instanceView"]["utilizationInfo"]["currentCapacity"] == 4
    status, body = await get(f"{fake_azure.url}{group}x", **api)
    assert (status, body["error"]["code"]) == (404, "ResourceNotFound")
    status, body = await get(fake_azure.url + group)
    assert (status, body["error"]["code"]) == (400, "MissingApiVersionParameter")
    fake_azure.fail("reservation_groups", status=403, code="AuthorizationFailed")
    status, body = await get(f"{base}/providers/Microsoft.Compute/capacityReservationGroups",
                             **api)
    assert (status, body["error"]["code"]) == (403, "AuthorizationFailed")
    assert fake_azure.call_count("reservation_groups") == 3
    assert fake_azure.call_count("reservation_group", "eastus") == 2
    assert fake_azure.call_count("reservation_group", "") == 1  # the one that is not there
    assert fake_azure.call_count("reservations", "eastus") == 1
    assert fake_azure.call_count("reservation", "eastus") == 1
