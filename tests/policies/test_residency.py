"""Built-in residency tags per cloud region naming, and a policy's extensions."""

from __future__ import annotations

import pytest

from policies.residency import Residency, built_in


@pytest.mark.parametrize(("cloud", "region", "tags"), [
    ("aws", "us-east-1", {"us", "na"}),
    ("aws", "ca-central-1", {"ca", "na"}),
    ("aws", "eu-central-1", {"eu", "europe"}),
    ("aws", "eu-west-1", {"eu", "europe"}),
    ("aws", "eu-west-2", {"uk", "europe"}),
    ("aws", "eu-north-1", {"eu", "europe"}),
    ("aws", "ap-northeast-1", {"asia", "jp"}),
    ("aws", "ap-southeast-2", {"au", "oceania"}),
    ("aws", "ap-south-1", {"asia", "in"}),
    ("aws", "sa-east-1", {"sa"}),
    ("aws", "me-central-1", {"me"}),
    ("gcp", "us-central1", {"us", "na"}),
    ("gcp", "europe-west4", {"eu", "europe"}),
    ("gcp", "europe-west2", {"uk", "europe"}),
    ("gcp", "europe-west6", {"ch", "europe"}),
    ("gcp", "asia-northeast1", {"asia", "jp"}),
    ("gcp", "asia-east1", {"asia", "tw"}),
    ("gcp", "northamerica-northeast1", {"ca", "na"}),
    ("gcp", "australia-southeast1", {"au", "oceania"}),
    ("azure", "eastus", {"us", "na"}),
    ("azure", "westus2", {"us", "na"}),
    ("azure", "southcentralus", {"us", "na"}),
    ("azure", "westeurope", {"eu", "europe"}),
    ("azure", "swedencentral", {"eu", "europe"}),
    ("azure", "uksouth", {"uk", "europe"}),
    ("azure", "switzerlandnorth", {"ch", "europe"}),
    ("azure", "japaneast", {"asia", "jp"}),
    ("azure", "australiaeast", {"au", "oceania"}),
    ("alibaba", "cn-hangzhou", {"asia", "cn"}),
    ("alibaba", "cn-hongkong", {"asia", "hk"}),
    ("alibaba", "ap-southeast-1", {"asia", "sg"}),
    ("alibaba", "eu-central-1", {"eu", "europe"}),
    ("alibaba", "us-west-1", {"us", "na"}),
    ("aws", "sim-aws-r042", set()),
    ("nocloud", "us-east-1", set()),
])
def test_built_in_tags(cloud: str, region: str, tags: set[str]) -> None:
    assert built_in(cloud, region) == tags


def test_policy_extensions_add_tags_for_one_cloud_or_any() -> None:
    r = Residency({"sovereign": ["aws:eu-central-1", "europe-west3"], "eu": ["aws:il-central-1"]})
    assert r.of("aws", "eu-central-1") == {"eu", "europe", "sovereign"}
    assert r.of("gcp", "eu-central-1") == set()  # only AWS's region was named
    assert r.of("gcp", "europe-west3") == {"eu", "europe", "sovereign"}
    assert r.of("aws", "il-central-1") == {"me", "eu"}
    assert "sovereign" in r.tags and "eu" in r.tags
