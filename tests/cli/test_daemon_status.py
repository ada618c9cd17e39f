"""`gpubroker status`: the site's leader and nodes, read from a real PostgreSQL database
that `broker.state.leadership.Leadership` objects of two nodes wrote, by the command run as a
process.

The nodes here never run a daemon: each `Leadership` claims or stands by as the daemon's
would, on the database of the `pg_url` fixture (a fresh one per test)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from broker.state.leadership import Leadership
from broker.state.pgstore import PgStateStore

SITE = "lab-1"

NODE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["node", "role", "epoch", "boot_id", "version", "started_at",
                 "seen_seconds_ago"],
    "properties": {
        "node": {"type": "string", "minLength": 1},
        "role": {"enum": ["leader", "standby", "stopped"]},
        "epoch": {"type": "integer", "minimum": 0},
        "boot_id": {"type": "string", "format": "uuid"},
        "version": {"type": "string", "minLength": 1},
        "started_at": {"type": "string",
                       "pattern": r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$"},
        "seen_seconds_ago": {"type": "number", "minimum": 0},
    },
}
STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["site", "high_availability", "database", "leadership_seconds", "leader",
                 "epoch", "claimed_by", "expires_in_seconds", "nodes"],
    "properties": {
        "site": {"type": "string"},
        "high_availability": {"type": "boolean"},
        "database": {"type": "string"},
        "leadership_seconds": {"type": ["number", "null"]},
        "leader": {"type": ["string", "null"]},
        "epoch": {"type": "integer", "minimum": 0},
        "claimed_by": {"type": ["string", "null"]},
        "expires_in_seconds": {"type": ["number", "null"]},
        "nodes": {"type": "array", "items": NODE_SCHEMA},
    },
}


def gpubroker(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=60, check=False)


async def status(config: Path, fmt: str = "table") -> subprocess.CompletedProcess[str]:
    """The command, in a thread: the nodes' event loop keeps running meanwhile."""
    return await asyncio.to_thread(gpubroker, "status", "--config", config, "--format", fmt)


def as_json(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    doc: dict[str, Any] = json.loads(r.stdout)
    jsonschema.validate(doc, STATUS_SCHEMA, format_checker=jsonschema.FormatChecker())
    return doc


def one_line(r: subprocess.CompletedProcess[str], code: int) -> str:
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == code, (r.returncode, r.stderr)
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("gpubroker: "), lines[0]
    return lines[0]


def table_rows(stdout: str) -> dict[str, list[str]]:
    """The node table: NODE -> [ROLE, EPOCH, VERSION, STARTED, LAST SEEN]."""
    lines = stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("NODE "))
    rows: dict[str, list[str]] = {}
    for line in lines[head + 1:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != 6:
            break
        rows[cells[0]] = cells[1:]
    return rows


def write_config(tmp_path: Path, url: str, *, seconds: float = 30.0, site: str = SITE,
                 extra: str = "") -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(f"site: {site}\nnode: node-a\nstate:\n  url: {url}\n"
                    f"  leadership_seconds: {seconds}\n{extra}")
    return path


@pytest.fixture
async def store(pg_url: str) -> AsyncIterator[PgStateStore]:
    """The site's database, migrated as a daemon's first start does."""
    s = PgStateStore(pg_url, site=SITE)
    await s.open()
    try:
        yield s
    finally:
        await s.close()


@contextlib.asynccontextmanager
async def node(store: PgStateStore, name: str, seconds: float) -> AsyncIterator[Leadership]:
    ha = Leadership(store, site=SITE, node=name, boot_id=str(uuid.uuid4()), seconds=seconds)
    try:
        yield ha
    finally:
        await ha.close()


async def stand_by_once(ha: Leadership) -> None:
    """One round of standing by: a claim that finds the leader, and the node's heartbeat.
    `stop` is set just after `acquire` has entered its loop (callbacks run in order), so
    it makes exactly one attempt and returns."""
    stop = asyncio.Event()
    task = asyncio.create_task(ha.acquire(stop))
    asyncio.get_running_loop().call_soon(stop.set)
    async with asyncio.timeout(10):
        assert await task is None


async def test_a_leader_and_a_standby(store: PgStateStore, tmp_path: Path) -> None:
    config = write_config(tmp_path, store.url)
    async with node(store, "node-a", 30) as a, node(store, "node-b", 30) as b:
        assert await a.acquire(asyncio.Event()) == 1
        await stand_by_once(b)
        assert b.leader == ("node-a", 1)

        r = await status(config)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        lines = r.stdout.splitlines()
        assert lines[0].startswith(f"site {SITE} on postgresql://postgres@127.0.0.1:5432/")
        assert re.fullmatch(r"leader: node node-a, epoch 1; its claim expires in "
                            r"(2[5-9]|30)\.\d s unless renewed", lines[1]), lines[1]
        rows = table_rows(r.stdout)
        assert set(rows) == {"node-a", "node-b"}
        assert rows["node-a"][:2] == ["leader", "1"]
        assert rows["node-b"][:2] == ["standby", "0"]
        for *_, started, seen in rows.values():
            assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", started), started
            assert re.fullmatch(r"\d+\.\d s ago", seen), seen
        assert "not seen for" not in r.stdout
        assert lines[-1] == "2 nodes"

        doc = as_json(await status(config, "json"))
        assert (doc["site"], doc["high_availability"], doc["leader"], doc["claimed_by"],
                doc["epoch"], doc["leadership_seconds"]) == (SITE, True, "node-a", "node-a",
                                                             1, 30)
        assert 25 < doc["expires_in_seconds"] <= 30
        assert doc["database"].startswith("postgresql://postgres@127.0.0.1:5432/gpbtest_")
        by_node = {n["node"]: n for n in doc["nodes"]}
        assert (by_node["node-a"]["role"], by_node["node-a"]["epoch"]) == ("leader", 1)
        assert (by_node["node-b"]["role"], by_node["node-b"]["epoch"]) == ("standby", 0)
        assert by_node["node-a"]["boot_id"] == a.boot_id
        assert all(n["seen_seconds_ago"] < 20 for n in doc["nodes"])


async def test_after_an_orderly_stop_the_standby_leads_with_the_next_epoch(
        store: PgStateStore, tmp_path: Path) -> None:
    config = write_config(tmp_path, store.url)
    async with node(store, "node-a", 30) as a, node(store, "node-b", 30) as b:
        assert await a.acquire(asyncio.Event()) == 1
        await stand_by_once(b)
        await a.release()
        async with asyncio.timeout(10):
            assert await b.acquire(asyncio.Event()) == 2

        r = await status(config)
        assert r.returncode == 0, r.stderr
        assert "leader: node node-b, epoch 2;" in r.stdout
        rows = table_rows(r.stdout)
        assert rows["node-a"][:2] == ["stopped", "1"]
        assert rows["node-b"][:2] == ["leader", "2"]

        doc = as_json(await status(config, "json"))
        assert (doc["leader"], doc["epoch"]) == ("node-b", 2)
        assert {n["node"]: n["role"] for n in doc["nodes"]} == {"node-a": "stopped",
                                                                "node-b": "leader"}


async def test_an_expired_claim_and_a_node_gone_silent(store: PgStateStore,
                                                       tmp_path: Path) -> None:
    # The leader claims for 1 s and never renews (a frozen or killed process): its claim
    # expires, and after leadership_seconds + 1 without a heartbeat it is said to be gone.
    config = write_config(tmp_path, store.url, seconds=1)
    async with node(store, "node-a", 1) as a:
        assert await a.acquire(asyncio.Event()) == 1
        a._stop_renewing.set()  # frozen: the renewals (a thread from the claim on) stop
        await asyncio.sleep(2.3)

        r = await status(config)
        assert r.returncode == 0, r.stderr
        assert re.search(r"^leader: none: the claim of node node-a \(epoch 1\) expired "
                         r"\d+\.\d s ago; a standby takes over at its next claim$",
                         r.stdout, re.M), r.stdout
        assert re.search(r"^node node-a: not seen for \d+\.\d s: stopped, or cut off from "
                         r"the database$", r.stdout, re.M), r.stdout
        assert table_rows(r.stdout)["node-a"][:2] == ["leader", "1"]  # as it last wrote

        doc = as_json(await status(config, "json"))
        assert (doc["leader"], doc["claimed_by"], doc["epoch"]) == (None, "node-a", 1)
        assert doc["expires_in_seconds"] < 0
        assert doc["nodes"][0]["seen_seconds_ago"] > 2


async def test_a_site_where_no_node_has_led_yet(store: PgStateStore, tmp_path: Path) -> None:
    config = write_config(tmp_path, store.url)
    r = await status(config)
    assert r.returncode == 0, r.stderr
    assert "leader: none yet: no node has led this site" in r.stdout
    assert r.stdout.splitlines()[-1] == "0 nodes"
    doc = as_json(await status(config, "json"))
    assert (doc["leader"], doc["claimed_by"], doc["epoch"], doc["expires_in_seconds"],
            doc["nodes"]) == (None, None, 0, None, [])


def test_sqlite_is_a_single_daemon(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"site: {SITE}\nstate: {{path: {tmp_path / 'state.db'}}}\n")
    r = gpubroker("status", "--config", config)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout == (f"site {SITE}: state in the SQLite file {tmp_path / 'state.db'}: a "
                        "single daemon, no high availability (set state.url to run several)\n")
    doc = as_json(gpubroker("status", "--config", config, "--format", "json"))
    assert (doc["high_availability"], doc["database"], doc["leader"], doc["epoch"],
            doc["nodes"]) == (False, str(tmp_path / "state.db"), None, 0, [])
    assert not (tmp_path / "state.db").exists()  # nothing created


def test_a_database_that_cannot_be_reached_is_one_line_exit_1(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"postgresql://gpubroker@127.0.0.1:{port}/gpubroker"
    line = one_line(gpubroker("status", "--config", write_config(tmp_path, url)), 1)
    assert line.startswith(f"gpubroker: {url}: cannot read the site's status: "), line
    assert "refused" in line, line


async def test_a_database_no_daemon_has_started_on(pg_url: str, tmp_path: Path) -> None:
    line = one_line(await status(write_config(tmp_path, pg_url)), 1)
    assert line.endswith(f"no leadership in this database yet: no daemon of site {SITE} has "
                         "started on it"), line


async def test_another_sites_database_is_a_configuration_mistake(store: PgStateStore,
                                                                 tmp_path: Path) -> None:
    line = one_line(await status(write_config(tmp_path, store.url, site="lab-2")), 2)
    assert line.endswith(f"state.url: the database holds the state of site '{SITE}', not "
                         "'lab-2': each site needs a database of its own"), line


@pytest.mark.parametrize(("yaml", "words"), [
    ("site: lab-1\nstate: {url: 'postgresql://gpubroker:s3cret@db:5432/x'}\n",
     "state.url: put no password in the URL"),
    ("site: lab-1\nstate: {url: 'mysql://db/x'}\n", "state.url: must look like postgresql://"),
    ("site: lab-1\nstate: {url: 'postgresql://db/x', leadership_seconds: 0.5}\n",
     "state.leadership_seconds: Input should be greater than or equal to 1"),
    ("site: lab-1\nnode: 'no spaces'\n", "node: String should match pattern"),
    ("site: lab-1\nstate: {url: 'postgresql://db/x', leadership_secs: 3}\n",
     "state.leadership_secs: unknown key; did you mean 'leadership_seconds'?"),
], ids=["password in URL", "not postgresql", "leadership too short", "bad node", "typo"])
def test_a_bad_configuration_is_exit_2(tmp_path: Path, yaml: str, words: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml)
    line = one_line(gpubroker("status", "--config", config), 2)
    assert words in line, line
    assert "s3cret" not in line


def test_an_unreadable_password_file_is_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "credentials" / "postgresql"
    config = write_config(tmp_path, "postgresql://gpubroker@127.0.0.1:5432/gpubroker",
                          extra=f"  password_file: {missing}\n")
    line = one_line(gpubroker("status", "--config", config), 2)
    assert line == (f"gpubroker: {missing}: state.password_file: cannot read: No such file or "
                    "directory")
