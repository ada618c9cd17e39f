"""Region residency tags: where a cloud region's data lives, so a policy can say "EU
only" without listing regions.

Built-in tags, for every cloud's region naming:

| tag | regions |
|---|---|
| `us` | United States |
| `ca` | Canada |
| `na` | `us` + `ca` + Mexico |
| `eu` | European Union / EEA member states |
| `uk`, `ch` | United Kingdom, Switzerland |
| `europe` | `eu` + `uk` + `ch` + other European regions |
| `asia` | Asia-Pacific, including mainland China and Hong Kong |
| `cn` | mainland China (Hong Kong is `hk`, not `cn`) |
| `jp`, `kr`, `in`, `sg`, `hk`, `tw`, `id` | single countries / territories |
| `au` | Australia and New Zealand (also `oceania`) |
| `sa` | South America |
| `me`, `af` | Middle East, Africa |

A policy extends them (`residency.tags: {sovereign-eu: [aws:eu-central-1, ...]}`) and
may add regions to a built-in tag. Regions gpubroker cannot place (the simulated market's
synthesized names) carry no tag.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# (pattern on the region name, tags); first match wins. Patterns are per naming scheme.
_AWS_LIKE: tuple[tuple[str, tuple[str, ...]], ...] = (
    # AWS, and Alibaba's non-China regions use the same scheme.
    (r"^us-", ("us", "na")),
    (r"^ca-", ("ca", "na")),
    (r"^mx-", ("na",)),
    (r"^eu-(central|west-1|west-3|north|south)", ("eu", "europe")),
    (r"^eu-west-2", ("uk", "europe")),
    (r"^eu-", ("europe",)),
    (r"^ap-northeast-1", ("asia", "jp")),
    (r"^ap-northeast-3", ("asia", "jp")),
    (r"^ap-northeast-2", ("asia", "kr")),
    (r"^ap-south-\d", ("asia", "in")),
    (r"^ap-southeast-1", ("asia", "sg")),
    (r"^ap-southeast-2", ("au", "oceania")),
    (r"^ap-southeast-3", ("asia", "id")),
    (r"^ap-southeast-4", ("au", "oceania")),
    (r"^ap-southeast-5", ("asia",)),
    (r"^ap-east-1", ("asia", "hk")),
    (r"^ap-", ("asia",)),
    (r"^cn-hongkong", ("asia", "hk")),
    (r"^cn-", ("asia", "cn")),
    (r"^sa-", ("sa",)),
    (r"^me-", ("me",)),
    (r"^il-", ("me",)),
    (r"^af-", ("af",)),
)

_GCP: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"^us-", ("us", "na")),
    (r"^northamerica-northeast", ("ca", "na")),
    (r"^northamerica-south", ("na",)),
    (r"^europe-west2", ("uk", "europe")),
    (r"^europe-west6", ("ch", "europe")),
    (r"^europe-", ("eu", "europe")),
    (r"^asia-northeast[12]", ("asia", "jp")),
    (r"^asia-northeast3", ("asia", "kr")),
    (r"^asia-south", ("asia", "in")),
    (r"^asia-southeast1", ("asia", "sg")),
    (r"^asia-southeast2", ("asia", "id")),
    (r"^asia-east1", ("asia", "tw")),
    (r"^asia-east2", ("asia", "hk")),
    (r"^asia-", ("asia",)),
    (r"^australia-", ("au", "oceania")),
    (r"^southamerica-", ("sa",)),
    (r"^me-", ("me",)),
    (r"^africa-", ("af",)),
)

_AZURE: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"^(east|west|central|north|south|westcentral|southcentral|northcentral)us", ("us", "na")),
    (r"^canada", ("ca", "na")),
    (r"^mexico", ("na",)),
    (r"^uk", ("uk", "europe")),
    (r"^switzerland", ("ch", "europe")),
    (r"^norway", ("europe",)),
    (r"^(westeurope|northeurope|france|germany|sweden|poland|italy|spain|austria|belgium|"
     r"denmark|finland|greece)", ("eu", "europe")),
    (r"^japan", ("asia", "jp")),
    (r"^korea", ("asia", "kr")),
    (r"^(central|south|west|jio)india", ("asia", "in")),
    (r"^southeastasia", ("asia", "sg")),
    (r"^eastasia", ("asia", "hk")),
    (r"^indonesia", ("asia", "id")),
    (r"^(malaysia|taiwan)", ("asia",)),
    (r"^(australia|newzealand)", ("au", "oceania")),
    (r"^brazil", ("sa",)),
    (r"^chile", ("sa",)),
    (r"^(uae|qatar|israel|saudi)", ("me",)),
    (r"^southafrica", ("af",)),
    (r"^china", ("asia", "cn")),
)

_RULES = {"aws": _AWS_LIKE, "alibaba": _AWS_LIKE, "gcp": _GCP, "azure": _AZURE}
_COMPILED = {cloud: tuple((re.compile(p), frozenset(t)) for p, t in rules)
             for cloud, rules in _RULES.items()}

BUILT_IN_TAGS = frozenset(
    {"us", "ca", "na", "eu", "uk", "ch", "europe", "asia", "cn", "jp", "kr", "in", "sg",
     "hk", "tw", "id", "au", "oceania", "sa", "me", "af"})


def built_in(cloud: str, region: str) -> frozenset[str]:
    """The built-in residency tags of a cloud region (empty if none applies)."""
    for pattern, tags in _COMPILED.get(cloud, ()):
        if pattern.match(region):
            return tags
    return frozenset()


class Residency:
    """Built-in tags plus a policy's extensions: `extra` maps a tag to regions written as
    `cloud:region` (one cloud) or `region` (that name in any cloud)."""

    def __init__(self, extra: Mapping[str, list[str]] | None = None) -> None:
        self._extra: dict[tuple[str | None, str], set[str]] = {}
        for tag, regions in (extra or {}).items():
            for r in regions:
                cloud, _, name = r.rpartition(":")
                self._extra.setdefault((cloud or None, name), set()).add(tag)
        self._cache: dict[tuple[str, str], frozenset[str]] = {}
        self.tags = BUILT_IN_TAGS | frozenset((extra or {}).keys())
        self.key = frozenset((where, frozenset(tags)) for where, tags in self._extra.items())
        """What `of` reads beyond the built-in tags: equal keys, equal tags everywhere."""

    def of(self, cloud: str, region: str) -> frozenset[str]:
        key = (cloud, region)
        tags = self._cache.get(key)
        if tags is None:
            tags = built_in(cloud, region) | self._extra.get((cloud, region), set()) | \
                self._extra.get((None, region), set())
            self._cache[key] = tags
        return tags
