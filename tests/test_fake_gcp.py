"""The fake Google Cloud itself: its catalog agrees with the price snapshot it is built
from, and it answers like the real APIs where the adapter's tests rely on it."""

from __future__ import annotations

import csv

import pytest
import requests
from fake_gcp import DEFAULT_PRICES_CSV, GPUS, FakeGCP, fake_gcp_fixture  # noqa: F401


def test_host_skus_reproduce_every_snapshot_host_price(fake_gcp: FakeGCP) -> None:
    rows = 0
    with DEFAULT_PRICES_CSV.open(newline="") as fh:
        for row in csv.DictReader(fh):
            if not row["instance_type"]:
                continue
            series = row["instance_type"].split("-")[0]
            for market, col in (("on_demand", "on_demand_usd_per_hour"),
                                ("spot", "spot_usd_per_hour")):
                if not row[col]:
                    continue
                core = fake_gcp.unit_price(row["region"], market, "core", series)
                ram = fake_gcp.unit_price(row["region"], market, "ram", series)
                assert core is not None and ram is not None
                price = core * int(row["vcpus"]) + ram * float(row["memory_gib"])
                assert price == pytest.approx(float(row[col]), abs=2e-5), row
                rows += 1
    assert rows > 1000


def test_gpu_skus_are_the_snapshot_price_per_gpu(fake_gcp: FakeGCP) -> None:
    assert fake_gcp.unit_price("us-central1", "on_demand", "gpu", "nvidia-tesla-a100") == 2.93391
    assert fake_gcp.unit_price("us-central1", "spot", "gpu", "nvidia-l4") == 0.2231
    mega = fake_gcp.unit_price("us-central1", "on_demand", "gpu", GPUS["H100-MEGA"][0])
    assert mega == pytest.approx(82.75421 / 8, abs=1e-9)


def test_errors_paging_and_filters_answer_like_compute_engine(fake_gcp: FakeGCP) -> None:
    base = f"{fake_gcp.url}/compute/v1/projects/{fake_gcp.project}"
    with requests.Session() as http:
        r = http.get(f"{base}/zones/us-central1-a/machineTypes",
                     params={"filter": 'name eq "a2-.*"', "maxResults": "2"})
        page = r.json()
        assert r.status_code == 200 and len(page["items"]) == 2 and page["nextPageToken"]
        assert all(i["name"].startswith("a2-") for i in page["items"])
        r = http.get(f"{base}/zones/us-central1-a/machineTypes",
                     params={"filter": 'name eq "a2-.*"', "pageToken": page["nextPageToken"]})
        assert r.status_code == 200 and r.json()["items"][0]["name"] not in {
            i["name"] for i in page["items"]}
        r = http.get(f"{base}/zones/us-central1-a/machineTypes",
                     params={"filter": 'name eq "n1-.*"', "pageToken": page["nextPageToken"]})
        assert r.status_code == 400  # a token belongs to its own query
        assert http.get(f"{base}/zones/us-central1-a/machineTypes",
                        params={"maxResults": "501"}).status_code == 400
        assert http.get(f"{base}/zones/us-central1-a/machineTypes",
                        params={"filter": "name:a2"}).status_code == 400
        fake_gcp.fail("regions.get", 429, retry_after=3)
        r = http.get(f"{base}/regions/us-central1")
        assert r.status_code == 429 and r.headers["Retry-After"] == "3"
        err = r.json()["error"]
        assert err["status"] == "RESOURCE_EXHAUSTED"
        assert err["errors"][0]["reason"] == "rateLimitExceeded"
        assert err["details"][0]["reason"] == "RATE_LIMIT_EXCEEDED"
        assert http.get(f"{base}/regions/us-central1").status_code == 200
    assert fake_gcp.call_count("regions.get", "us-central1") == 2
