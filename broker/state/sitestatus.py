"""The site's leadership and nodes as the database has them, for `gpubroker status`:
read with a connection of its own, next to the running daemons."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from broker.state.pgstore import PgStateStore


@dataclass(frozen=True, slots=True)
class NodeInfo:
    node: str
    role: str
    epoch: int
    boot_id: str
    version: str
    started_at: datetime
    seen_seconds_ago: float


@dataclass(frozen=True, slots=True)
class SiteStatus:
    site: str
    leader: str | None
    epoch: int
    expires_in_seconds: float | None
    nodes: list[NodeInfo]


def site_status(store: PgStateStore, site: str) -> SiteStatus:
    """The site's leadership and nodes as the database has them (blocking)."""
    with store.connect() as conn:
        row = conn.execute("SELECT l.node, l.epoch, EXTRACT(EPOCH FROM t.expires_at - now()) "
                           "FROM leadership l JOIN leadership_term t USING (site) "
                           "WHERE l.site = %s", (site,)).fetchone()
        nodes = [NodeInfo(n, role, int(e), boot, ver, started, float(ago))
                 for n, role, e, boot, ver, started, ago in conn.execute(
                     "SELECT node, role, epoch, boot_id, version, started_at, "
                     "EXTRACT(EPOCH FROM now() - seen_at) FROM nodes ORDER BY node")]
    if row is None:
        return SiteStatus(site, None, 0, None, nodes)
    return SiteStatus(site, row[0], int(row[1]), float(row[2]), nodes)
