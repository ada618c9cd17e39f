"""The fake Google Cloud itself: its catalog agrees with the price snapshot it is built
from, and it answers like the real APIs where the adapter's tests rely on it."""

from __future__ import annotations

import csv

import pytest
import requests
from fake_gcp import (  # noqa: F401
    DEFAULT_PRICES_CSV,
    GPUS,
    OWN_SKU_TARGETS,
    FakeGCP,
    fake_gcp_fixture,
    sku_series,
)
from fake_server import Chaos


def test_host_skus_reproduce_every_snapshot_host_price(fake_gcp: FakeGCP) -> None:
    """A3 Mega's and Ultra's own SKUs: the snapshot's price scaled to their target."""
    with DEFAULT_PRICES_CSV.open(newline="") as fh:
        snapshot = [row for row in csv.DictReader(fh) if row["instance_type"]]
    scale = {series: target / next(
        float(r["on_demand_usd_per_hour"]) for r in snapshot
        if r["instance_type"] == itype and r["region"] == "us-central1")
        for series, (itype, target) in OWN_SKU_TARGETS.items()}
    rows = 0
    for row in snapshot:
        series = sku_series(row["instance_type"])
        for market, col in (("on_demand", "on_demand_usd_per_hour"),
                            ("spot", "spot_usd_per_hour")):
            if not row[col]:
                continue
            core = fake_gcp.unit_price(row["region"], market, "core", series)
            ram = fake_gcp.unit_price(row["region"], market, "ram", series)
            assert core is not None and ram is not None
            price = core * int(row["vcpus"]) + ram * float(row["memory_gib"])
            assert price == pytest.approx(float(row[col]) * scale.get(series, 1.0),
                                          abs=2e-5), row
            rows += 1
    assert rows > 1000
    assert {sku_series(r["instance_type"]) for r in snapshot} >= {"a3", "a3plus", "a3ultra"}


def test_a3_mega_ultra_and_local_ssd_skus_are_the_catalogs(fake_gcp: FakeGCP) -> None:
    assert fake_gcp.unit_price("us-central1", "on_demand", "core", "a3plus") == 0.026924
    assert fake_gcp.unit_price("us-central1", "on_demand", "ram", "a3plus") == 0.002344
    skus = {s["description"]: s for s in fake_gcp.skus()}
    assert {"A3Plus Instance Core running in Iowa", "A3Plus Instance Ram running in Iowa",
            "Spot Preemptible A3Ultra Instance Core running in Iowa"} <= set(skus)
    ssd = skus["SSD backed Local Storage in Virginia"]
    assert ssd["category"] == {"serviceDisplayName": "Compute Engine",
                               "resourceFamily": "Storage", "resourceGroup": "LocalSSD",
                               "usageType": "OnDemand"}
    assert ssd["serviceRegions"] == ["us-east4"]
    assert ssd["pricingInfo"][0]["pricingExpression"]["usageUnit"] == "GiBy.mo"
    spot = [s for d, s in skus.items()
            if d.startswith("SSD backed Local Storage attached to Spot Preemptible VMs")]
    assert {s["category"]["usageType"] for s in spot} == {"OnDemand", "Preemptible"}
    assert "SSD backed Local Storage" in skus  # the Americas SKU names no region


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


def test_random_faults_answer_in_googles_shapes(fake_gcp: FakeGCP) -> None:
    base = f"{fake_gcp.url}/compute/v1/projects/{fake_gcp.project}"
    skus = f"{fake_gcp.url}/v1/services/6F81-5844-456A/skus"
    with requests.Session() as http:
        fake_gcp.chaos = Chaos(rate=1.0, kinds=("throttle",))
        r = http.get(skus)  # the Billing Catalog: AIP-193's RESOURCE_EXHAUSTED
        err = r.json()["error"]
        assert r.status_code == 429 and err["status"] == "RESOURCE_EXHAUSTED"
        assert "errors" not in err
        assert {d["@type"].rsplit(".", 1)[1]: d.get("reason", d.get("retryDelay"))
                for d in err["details"]} == {"ErrorInfo": "RATE_LIMIT_EXCEEDED",
                                             "RetryInfo": "1s"}
        legacy = http.get(f"{base}/regions/us-central1")  # Compute Engine: 403, then 429
        assert legacy.status_code == 403 and legacy.json() == {"error": {
            "code": 403, "message": "Rate Limit Exceeded", "errors": [{
                "message": "Rate Limit Exceeded", "domain": "usageLimits",
                "reason": "rateLimitExceeded"}]}}
        r = http.get(f"{base}/regions/us-central1")
        assert r.status_code == 429
        assert r.json()["error"]["errors"][0]["reason"] == "rateLimitExceeded"
        assert http.post(f"{fake_gcp.url}/token").status_code == 200  # spared
        fake_gcp.chaos = Chaos(rate=1.0, kinds=("5xx",))
        for _ in range(4):
            r = http.get(f"{base}/zones/us-central1-a/machineTypes")
            err = r.json()["error"]
            assert (r.status_code, err["status"]) in {(500, "INTERNAL"), (503, "UNAVAILABLE")}
            assert err["errors"][0]["reason"] == "backendError"
        fake_gcp.chaos = Chaos(rate=1.0, kinds=("truncated",))
        r = http.get(f"{base}/regions/us-central1")
        assert r.status_code == 200 and r.text.startswith('{"kind": "compute#region"')
        with pytest.raises(requests.exceptions.JSONDecodeError):
            r.json()
        fake_gcp.chaos = Chaos(rate=1.0, kinds=("throttle",))
        fake_gcp.spare_every = 2  # every second arrival of the same request is spared
        codes = [http.get(f"{base}/regions/europe-west4").status_code for _ in range(4)]
        assert codes[1] == codes[3] == 200 and codes[0] in (403, 429)
    # Calls the faults answered are counted like the others.
    assert fake_gcp.call_count("skus.list") == 1
    assert fake_gcp.call_count("regions.get", "us-central1") == 3
    assert fake_gcp.call_count("machineTypes.list", "us-central1-a") == 4
    assert fake_gcp.call_count("regions.get", "europe-west4") == 4
    assert fake_gcp.faulted == {"throttle": 5, "5xx": 4, "truncated": 1}


def test_reservations_answer_in_the_v1_rest_shape(fake_gcp: FakeGCP) -> None:
    base = f"{fake_gcp.url}/compute/v1/projects/{fake_gcp.project}"
    for n in range(4):
        fake_gcp.add_reservation("us-central1-a", f"r{n}", "n1-standard-8", 2, in_use=1,
                                 accelerators=(("nvidia-tesla-t4", 1),))
    fake_gcp.add_reservation("europe-west4-a", "eu", "a2-highgpu-1g", 3, specific=False,
                             raw={"specificReservation.inUseCount": None})
    with requests.Session() as http:
        first = http.get(f"{base}/aggregated/reservations").json()
        assert first["kind"] == "compute#reservationAggregatedList" and first["nextPageToken"]
        scope = first["items"]["zones/us-central1-a"]
        r0 = scope["reservations"][0]
        assert r0["kind"] == "compute#reservation" and r0["name"] == "r0"
        assert r0["zone"].endswith(f"/projects/{fake_gcp.project}/zones/us-central1-a")
        assert r0["specificReservation"] == {
            "count": "2", "inUseCount": "1", "assuredCount": "2",  # int64: strings
            "instanceProperties": {"machineType": "n1-standard-8", "guestAccelerators": [
                {"acceleratorType": "nvidia-tesla-t4", "acceleratorCount": 1}]}}
        assert (r0["status"], r0["specificReservationRequired"]) == ("READY", True)
        assert first["items"]["zones/us-central1-b"]["warning"]["code"] == "NO_RESULTS_ON_PAGE"
        second = http.get(f"{base}/aggregated/reservations",
                          params={"pageToken": first["nextPageToken"]}).json()
        assert "nextPageToken" not in second  # three a page, in zone and name order
        assert [r["name"] for r in second["items"]["zones/us-central1-a"]["reservations"]
                ] == ["r2", "r3"]
        eu = first["items"]["zones/europe-west4-a"]["reservations"][0]
        assert "inUseCount" not in eu["specificReservation"]
        assert eu["specificReservationRequired"] is False
        listed = http.get(f"{base}/zones/us-central1-a/reservations",
                          params={"maxResults": "10"}).json()
        assert listed["kind"] == "compute#reservationList" and len(listed["items"]) == 3
        got = http.get(f"{base}/zones/us-central1-a/reservations/r3")
        assert got.status_code == 200 and got.json()["name"] == "r3"
        assert http.get(f"{base}/zones/us-central1-a/reservations/nope").status_code == 404
        assert http.get(f"{base}/aggregated/reservations",
                        params={"filter": "status eq READY"}).status_code == 400
        fake_gcp.fail("reservations.aggregatedList", 403, message="Required "
                      "'compute.reservations.list' permission")
        err = http.get(f"{base}/aggregated/reservations").json()["error"]
        assert err["code"] == 403 and err["status"] == "PERMISSION_DENIED"
        fake_gcp.chaos = Chaos(rate=1.0, kinds=("5xx",))
        assert http.get(f"{base}/aggregated/reservations").status_code in (500, 503)
        assert http.get(f"{base}/zones/us-central1-a/reservations/r1").status_code in (500,
                                                                                      503)
    assert fake_gcp.call_count("reservations.aggregatedList") == 5
    assert fake_gcp.call_count("reservations.list", "us-central1") == 1
    assert fake_gcp.call_count("reservations.get", "us-central1-a") == 3


def test_capacity_advice_answers_in_the_rest_shape(fake_gcp: FakeGCP) -> None:
    url = (f"{fake_gcp.url}/compute/v1/projects/{fake_gcp.project}/regions/us-central1/"
           "advice/capacity")
    fake_gcp.set_capacity_advice("us-central1-a", "a2-highgpu-1g", "SPOT",
                                 obtainability=0.42, uptime_seconds=5400)

    def body(model: str, machine: str = "a2-highgpu-1g", zone: str = "zones/us-central1-a",
             accelerators: list[dict[str, object]] | None = None) -> dict[str, object]:
        selection: dict[str, object] = {"machineTypes": [machine]}
        if accelerators:
            selection["guestAccelerators"] = accelerators
        return {"instanceProperties": {"scheduling": {"provisioningModel": model}},
                "instanceFlexibilityPolicy": {"instanceSelections": {"s": selection}},
                "size": 1, "distributionPolicy": {"zones": [{"zone": zone}],
                                                  "targetShape": "ANY_SINGLE_ZONE"}}

    answer = requests.post(url, json=body("SPOT"), timeout=10).json()
    assert answer == {"recommendations": [{
        "scores": {"obtainability": 0.42, "estimatedUptime": "5400s"},
        "shards": [{"zone": "us-central1-a", "machineType": "a2-highgpu-1g",
                    "provisioningModel": "SPOT", "instanceCount": 1}]}]}
    standard = requests.post(url, json=body("STANDARD"), timeout=10).json()
    scores = standard["recommendations"][0]["scores"]
    assert set(scores) == {"obtainability"} and 0.3 <= scores["obtainability"] <= 1.0
    t4 = [{"acceleratorType": "nvidia-tesla-t4", "acceleratorCount": 1}]
    assert requests.post(url, json=body("SPOT", "n1-standard-8", accelerators=t4),
                         timeout=10).status_code == 200
    assert fake_gcp.call_count("advice.capacity", "us-central1-a") == 3
    for bad in (body("FLEX"), body("SPOT", "a9-nothing"), body("SPOT", zone="zones/x-1-a"),
                body("SPOT", "n1-standard-8", accelerators=[
                    {"acceleratorType": "nvidia-tesla-t4", "acceleratorCount": 99}])):
        r = requests.post(url, json=bad, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400
    fake_gcp.advice_denied = True
    r = requests.post(url, json=body("SPOT"), timeout=10)
    error = r.json()["error"]
    assert r.status_code == 403 and error["status"] == "PERMISSION_DENIED"
    assert error["errors"][0]["reason"] == "forbidden"
    assert "compute.advice.capacity" in error["message"]
