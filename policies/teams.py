"""A team's limits, written once: what its active leases hold (`TeamUsage`), and what it
may still take in a batch (`TeamRoom`): GPUs (`max_gpus`), dollars per hour
(`budget_per_hour`), paid-for GPUs (`private_share`) and how its GPUs spread over zones
and clouds (`max_zone_share`, `max_cloud_share`, `spread_grace_gpus`).

`policies.evaluate` denies a request its team's GPUs cannot take and gives the rest of the
limits to the optimizer; the solver (`broker.placement`) counts placements against them
with `TeamRoom.binding`, `TeamRoom.count` and `TeamRoom.spread_allows`, in its heuristic, its MILP
rows (`TeamRoom.rows`) and its explanation of a request left unplaced."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

EPS = 1e-9
"""The tolerance every limit is compared with (amounts are sums of floats)."""


@dataclass(frozen=True, slots=True)
class TeamUsage:
    """What a team's active leases hold now."""

    gpus: int = 0
    price_per_hour: float = 0.0
    gpus_by_zone: Mapping[tuple[str, str], int] = field(default_factory=dict)
    owned_gpus: int = 0  # on paid-for capacity (the `reserved` market)


@dataclass(slots=True)
class TeamRoom:
    """What a team may still take in this batch. Shares are of the team's GPUs after the
    batch; `grace` GPUs may sit in one zone or cloud whatever the share."""

    gpus_left: float | None = None
    budget_left: float | None = None
    zone_share: float | None = None
    cloud_share: float | None = None
    grace: int = 0
    total: int = 0
    by_zone: dict[tuple[str, str], int] = field(default_factory=dict)
    by_cloud: dict[str, int] = field(default_factory=dict)
    owned_left: float | None = None  # paid-for GPUs it may still take (private_share)

    @property
    def spreads(self) -> bool:
        return self.zone_share is not None or self.cloud_share is not None

    @property
    def limited(self) -> bool:
        """Whether it has a GPU, budget or paid-for limit (`binding` can fail)."""
        return self.gpus_left is not None or self.budget_left is not None \
            or self.owned_left is not None

    def copy(self) -> TeamRoom:
        return TeamRoom(self.gpus_left, self.budget_left, self.zone_share, self.cloud_share,
                    self.grace, self.total, dict(self.by_zone), dict(self.by_cloud),
                    self.owned_left)

    def binding(self, gpus: float, price: float = 0.0, owned: float = 0.0
                ) -> tuple[str, float] | None:
        """The first of its limits that `gpus` more GPUs at `price` per hour (`owned` of
        them on paid-for capacity) would pass — "team_gpus", "team_budget" or
        "team_owned", with what is left of it —, or None when all of them allow it."""
        if self.gpus_left is not None and self.gpus_left < gpus - EPS:
            return "team_gpus", self.gpus_left
        if self.budget_left is not None and self.budget_left < price - EPS:
            return "team_budget", self.budget_left
        if owned and self.owned_left is not None and self.owned_left < owned - EPS:
            return "team_owned", self.owned_left
        return None

    def rows(self, gpus: float, price: float, owned: float
             ) -> list[tuple[str, float, float]]:
        """The limits as linear rows: (name, what is left, what `gpus` GPUs at `price`
        (`owned` of them paid-for) take of it), for the MILP; the same limits as
        `binding`'s."""
        out: list[tuple[str, float, float]] = []
        if self.gpus_left is not None:
            out.append(("gpus", self.gpus_left, gpus))
        if self.budget_left is not None:
            out.append(("budget", self.budget_left, price))
        if self.owned_left is not None and owned:
            out.append(("owned", max(self.owned_left, 0.0), owned))
        return out

    def count(self, gpus: int, price: float, owned: int, cloud: str, zone: str,
              sign: int = 1) -> None:
        """Count a placement (sign 1) against the limits, or no longer count it (-1)."""
        if self.gpus_left is not None:
            self.gpus_left -= sign * gpus
        if self.budget_left is not None:
            self.budget_left -= sign * price
        if self.owned_left is not None:
            self.owned_left -= sign * owned
        self.total += sign * gpus
        zk = (cloud, zone)
        self.by_zone[zk] = self.by_zone.get(zk, 0) + sign * gpus
        self.by_cloud[cloud] = self.by_cloud.get(cloud, 0) + sign * gpus

    def spread_allows(self, gpus: int, cloud: str, zone: str) -> bool:
        """Whether `gpus` more GPUs in `zone` of `cloud` keep it within its spread limits."""
        if not self.spreads:
            return True
        return self._spread_ok(gpus, self.by_zone.get((cloud, zone), 0),
                               self.by_cloud.get(cloud, 0))

    def spread_allows_somewhere(self, gpus: int) -> bool:
        """Whether `gpus` more GPUs keep it within its spread limits in a zone and a cloud
        where it has none: where it has some, fewer fit; if these do not fit there, they
        fit nowhere."""
        return not self.spreads or self._spread_ok(gpus, 0, 0)

    def _spread_ok(self, gpus: int, in_zone: int, in_cloud: int) -> bool:
        total = self.total + gpus
        if self.zone_share is not None and in_zone + gpus > \
                self.zone_share * total + self.grace + EPS:
            return False
        return not (self.cloud_share is not None and in_cloud + gpus >
                    self.cloud_share * total + self.grace + EPS)

    def spread_holds(self) -> bool:
        """Whether every zone and cloud is within its share (after a removal, which
        shrinks the total)."""
        if not self.spreads:
            return True
        if self.zone_share is not None and self.by_zone and \
                max(self.by_zone.values()) > self.zone_share * self.total + self.grace + EPS:
            return False
        return not (self.cloud_share is not None and self.by_cloud and
                    max(self.by_cloud.values()) > self.cloud_share * self.total + self.grace
                    + EPS)

    def spread_room(self, cloud: str, zone: str) -> tuple[float | None, float | None]:
        """GPUs the zone and the cloud may still take beyond their share of the batch's
        new GPUs (negative: over it already), for the MILP's spread rows; None: no
        such limit."""
        z = None if self.zone_share is None else \
            self.zone_share * self.total + self.grace - self.by_zone.get((cloud, zone), 0)
        c = None if self.cloud_share is None else \
            self.cloud_share * self.total + self.grace - self.by_cloud.get(cloud, 0)
        return z, c


def over_max_gpus(max_gpus: int | None, usage: TeamUsage, gpus: int) -> bool:
    """Whether `gpus` more GPUs would pass the team's `max_gpus` (a request alone)."""
    return max_gpus is not None and \
        TeamRoom(gpus_left=max_gpus - usage.gpus).binding(gpus) is not None
