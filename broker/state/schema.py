"""The state's tables, on either engine: the SQLite schema and its migrations (which
`broker.state.pgstore` translates for PostgreSQL), the statements that write a lease and
an outbox row, and how a lease and an outbox row map to a table's row and back."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from typing import Any

from broker.model import Lease, LeaseState, Placement, PlaceRequest, iso, parse_iso
from broker.wire.messages import OutboxRow, dumps

SCHEMA_VERSION = 7

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    lease_id   TEXT PRIMARY KEY,
    scheduler  TEXT NOT NULL,
    request_id TEXT NOT NULL,
    state      TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    body       TEXT NOT NULL,
    UNIQUE (scheduler, request_id)
);
CREATE INDEX IF NOT EXISTS leases_state ON leases (state, updated_at);
CREATE TABLE IF NOT EXISTS outbox (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,
    topic    TEXT NOT NULL,
    payload  BLOB NOT NULL,
    qos      INTEGER NOT NULL,
    retain   INTEGER NOT NULL,
    props    TEXT
);
-- The market history (broker/market/recorder.py). A pool row is one pool key together with the
-- GPU model and count it was offered with. A change row is that pool's full state from
-- `t` (epoch seconds) until its next row: kind 0 a change, 1 gone, 2 part of a snapshot
-- of every live pool (complete once its `t` is in market_snapshots). Fractional signals
-- are integers scaled by 10^6 (price in micro-USD per instance-hour), which SQLite packs
-- into 3-4 bytes where a REAL takes 8; NULL is unknown. Clustered on (t, pool_id), so
-- rows are appended in time order and exports and pruning read and delete sequentially;
-- there is deliberately no per-pool index (it would cost a page write per row).
CREATE TABLE IF NOT EXISTS market_pools (
    id            INTEGER PRIMARY KEY,
    cloud         TEXT NOT NULL,
    region        TEXT NOT NULL,
    zone          TEXT NOT NULL,
    instance_type TEXT NOT NULL,
    market        TEXT NOT NULL,
    gpu           TEXT NOT NULL,
    gpus          INTEGER NOT NULL,
    UNIQUE (cloud, region, zone, instance_type, market, gpu, gpus)
);
CREATE TABLE IF NOT EXISTS market_changes (
    t                    INTEGER NOT NULL,
    pool_id              INTEGER NOT NULL,
    price_e6             INTEGER,
    availability_e6      INTEGER,
    capacity             INTEGER,
    interruption_rate_e6 INTEGER,
    quota_headroom       INTEGER,
    kind                 INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (t, pool_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS market_snapshots (t INTEGER PRIMARY KEY);
"""

SCHEDSEQ_TABLE = ("CREATE TABLE IF NOT EXISTS schedseq (scheduler TEXT PRIMARY KEY, "
                  "last INTEGER NOT NULL);")
UPSERT_SCHEDSEQ = ("INSERT INTO schedseq (scheduler, last) VALUES (?,?) ON CONFLICT (scheduler) "
                   "DO UPDATE SET last=excluded.last")
ENDED_DETAIL = "failed before the daemon kept how a lease ended"
ENDED_BACKFILL = (
    "UPDATE leases SET body = json_set(body, "
    "'$.ended_reason', CASE state WHEN 'failed' THEN 'ended' ELSE state END, "
    f"'$.ended_detail', CASE state WHEN 'failed' THEN '{ENDED_DETAIL}' ELSE NULL END, "
    "'$.ended_at', updated_at) WHERE state <> 'active';")

# `SCHEMA` is schema 1 (plus the market tables): a new file gets it and then every
# migration, so that new and migrated files end with the same tables. A migration's
# statements are split on ";" and run in the transaction that opens the file.
MIGRATIONS: dict[int, str] = {
    # The leader's fencing epoch on every lease and outbox row (0 without high
    # availability: one daemon, no election).
    2: "ALTER TABLE leases ADD COLUMN leader_epoch INTEGER NOT NULL DEFAULT 0;"
       "ALTER TABLE outbox ADD COLUMN leader_epoch INTEGER NOT NULL DEFAULT 0;",
    # A lease's part of a split request (0: a whole request's lease; 1..n: part k, 1 the
    # head): a split request has one row per part, so the key is unique per part. SQLite
    # cannot change a table's UNIQUE constraint in place: the table is built anew
    # (dropping the old one drops its index, made again).
    3: """CREATE TABLE leases_3 (
    lease_id     TEXT PRIMARY KEY,
    scheduler    TEXT NOT NULL,
    request_id   TEXT NOT NULL,
    state        TEXT NOT NULL,
    updated_at   TEXT NOT NULL,
    body         TEXT NOT NULL,
    leader_epoch INTEGER NOT NULL DEFAULT 0,
    part         INTEGER NOT NULL DEFAULT 0,
    UNIQUE (scheduler, request_id, part)
);
INSERT INTO leases_3 (lease_id, scheduler, request_id, state, updated_at, body, leader_epoch)
    SELECT lease_id, scheduler, request_id, state, updated_at, body, leader_epoch FROM leases;
DROP TABLE leases;
ALTER TABLE leases_3 RENAME TO leases;
CREATE INDEX leases_state ON leases (state, updated_at);
""",
    # PostgreSQL only (broker.state.pgstore): the leadership's term in a row of its own. Nothing
    # changes in a SQLite file; the number stays the same on both engines.
    4: "",
    # PostgreSQL only: the leader's last poll of each slice, for the standbys.
    5: "",
    # How an ended lease ended, kept in its record (`ended_reason`, `ended_detail`,
    # `ended_at`; contract 1.1). A lease that ended before has its state as its reason
    # and its last change as its end; one that failed had its failover reason in no
    # record: `ended`, as a 1.0 daemon answered.
    6: ENDED_BACKFILL,
    # Each scheduler's last `schedseq` (contract 1.1): its events are numbered 1, 2, 3, …
    # across restarts and leaders, written in the transaction of the events.
    7: SCHEDSEQ_TABLE,
}


def statements(script: str) -> Iterator[str]:
    """The statements of an SQL script, one at a time (`;` in comments is no end)."""
    statement = ""
    for line in script.splitlines(keepends=True):
        statement += line
        if sqlite3.complete_statement(statement):
            yield statement
            statement = ""
    if statement.strip():
        raise ValueError(f"incomplete SQL statement: {statement.strip()[:80]}")


UPSERT_LEASE = (
    "INSERT INTO leases (lease_id, scheduler, request_id, state, updated_at, body, "
    "leader_epoch, part) VALUES (?,?,?,?,?,?,?,?) ON CONFLICT (lease_id) DO UPDATE SET "
    "state=excluded.state, updated_at=excluded.updated_at, body=excluded.body, "
    "leader_epoch=excluded.leader_epoch, part=excluded.part")
INSERT_OUTBOX = ("INSERT INTO outbox (topic, payload, qos, retain, props, leader_epoch) "
                 "VALUES (?,?,?,?,?,?)")


def lease_row(lease: Lease, epoch: int) -> tuple[str, str, str, str, str, str, int, int]:
    body = lease.to_json()
    body["request"] = lease.request.to_json()
    # The messages' JSON (`dumps`: orjson, 2 µs where the standard library takes 24 on the
    # loop's commit path) reads back the same values for what a lease can hold: no NaN
    # or infinity, no lone surrogate (requests refuse them, over MQTT and HTTP alike;
    # adapters drop non-finite numbers), where `dumps` would write null or U+FFFD.
    return (lease.lease_id, lease.scheduler, lease.request_id, lease.state.value,
            iso(lease.updated_at), dumps(body).decode(), epoch, lease.part)


def outbox_row(r: OutboxRow, epoch: int) -> tuple[str, bytes, int, int, str | None, int]:
    return (r.topic, r.payload, r.qos, int(r.retain),
            dumps(r.props).decode() if r.props else None, epoch)


def lease_from(d: dict[str, Any]) -> Lease:
    request = PlaceRequest.from_json(d["scheduler"], d["request"])
    return Lease(
        lease_id=d["lease_id"],
        scheduler=d["scheduler"],
        request_id=d["request_id"],
        request=request,
        placement=Placement.from_json(d["placement"]),
        epoch=d["epoch"],
        state=LeaseState(d["state"]),
        created_at=parse_iso(d["created_at"]),
        expires_at=parse_iso(d["expires_at"]),
        lease_seconds=d["lease_seconds"],
        max_price_per_gpu_hour=d["max_price_per_gpu_hour"],
        updated_at=parse_iso(d["updated_at"]),
        part=d.get("part", 0),
        parts=tuple(d.get("parts", ())),
        ended_reason=d.get("ended_reason"),
        ended_detail=d.get("ended_detail"),
        ended_at=parse_iso(d["ended_at"]) if d.get("ended_at") else None,
    )


def first_part(found: dict[tuple[str, str], list[Lease]], scheduler: str,
               request_id: str) -> Lease | None:
    """A request's lease, or its split's head, of what `find_leases` found: the lowest
    part (0 or 1)."""
    parts = found.get((scheduler, request_id))
    return parts[0] if parts else None
