"""Tests of the fake Azure endpoint (`tests/fake_azure.py`) with a plain HTTP client: the
shapes and the refusals a client relies on."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from fake_azure import SUBSCRIPTION_ID, FakeAzure, fake_azure_fixture  # noqa: F401

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
