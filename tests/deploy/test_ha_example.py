"""deploy/config.ha.example.yaml and deploy/INSTALL.md §7 (high availability).

* The example loads, for both nodes (the second made as the guide makes it), and the two
  differ only in `node`: one site, one database, one MQTT client id.
* Every high-availability key in it is explained by a comment, and the credential it
  reads the PostgreSQL password from is the one the guide's drop-in loads.
* The guide's SQL, run on a real PostgreSQL server, gives the daemon what it needs: its
  first start (the tables), a claim of the leadership and a fenced commit work as the
  role that owns the database, and after the second block as a role that may only read
  and write the tables, which cannot create one.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pg_helpers
import psycopg
import pytest
import yaml

from broker.daemon.config import load_config, parse_config
from broker.state.leadership import Leadership
from broker.state.pgstore import PgStateStore
from broker.state.sitestatus import site_status
from broker.wire.messages import OutboxRow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "config.ha.example.yaml"
SINGLE = ROOT / "deploy" / "config.example.yaml"
GUIDE = ROOT / "deploy" / "INSTALL.md"
CREDENTIAL = "/run/credentials/gpubroker.service/postgresql"
HA_KEYS = ["node", "state.url", "state.password_file", "state.leadership_seconds",
           "mqtt.client_id", "mqtt.session_expiry_seconds", "http.listen"]


def section_7() -> str:
    text = GUIDE.read_text(encoding="utf-8")
    m = re.search(r"^## 7\. .*?(?=^## |\Z)", text, re.S | re.M)
    assert m is not None, "deploy/INSTALL.md has no section 7"
    return m.group(0)


def second_node(text: str) -> str:
    """The guide's `sed -i 's/^node: broker-a /node: broker-b /'`."""
    assert "sed -i 's/^node: broker-a /node: broker-b /'" in section_7()
    out, n = re.subn(r"(?m)^node: broker-a ", "node: broker-b ", text)
    assert n == 1
    return out


def test_both_nodes_load_the_example_and_differ_only_in_node() -> None:
    text = EXAMPLE.read_text(encoding="utf-8")
    a, b = load_config(EXAMPLE), parse_config(second_node(text), "broker-b.yaml")
    assert (a.node, b.node) == ("broker-a", "broker-b")
    assert a.model_copy(update={"node": "x"}) == b.model_copy(update={"node": "x"})
    assert a.site == "lab-1" and a.client_id == "gpubroker-lab-1"  # the site's, on both
    url = urlsplit(a.state.url or "")
    assert (url.scheme, url.username, url.password, url.path) == (
        "postgresql", "gpubroker_lab_1", None, "/gpubroker_lab_1")
    assert "sslmode=verify-full" in url.query and "sslrootcert=" in url.query
    assert str(a.state.password_file) == CREDENTIAL
    assert a.state.leadership_seconds == 3
    assert a.mqtt.session_expiry_seconds > 0  # requests wait in the session meanwhile
    assert a.mqtt.tls and a.mqtt.password_file is not None
    assert a.clouds.sim is None and a.clouds.configured() == ["aws"]


def test_every_high_availability_key_is_explained() -> None:
    lines = EXAMPLE.read_text(encoding="utf-8").splitlines()
    data = yaml.safe_load(re.sub(r"(?m)^(\s*)# (\s*[a-z_]+:(?:\s|$))", r"\1\2",
                                 "\n".join(lines)))
    for key in HA_KEYS:
        *section, name = key.split(".")
        node = data
        for part in section:
            node = node[part]
        assert name in node, key
        indent = "  " * len(section)
        at = next(i for i, line in enumerate(lines)
                  if re.match(rf"{indent}(# )?{name}:", line))
        explained = "#" in lines[at].split(":", 1)[1] or lines[at - 1].strip().startswith("#")
        assert explained, f"{key}: no comment on or above line {at + 1}"


def test_the_password_credential_is_the_one_the_guide_loads() -> None:
    guide = section_7()
    assert "LoadCredential=postgresql:/etc/gpubroker/credentials/postgresql" in guide
    assert f"state.password_file: {CREDENTIAL}" in guide
    # The single-node example shows the same keys, commented out.
    single = SINGLE.read_text(encoding="utf-8")
    assert re.search(rf"(?m)^\s*# password_file: {re.escape(CREDENTIAL)}\s", single)
    assert re.search(r"(?m)^\s*# url: postgresql://gpubroker_lab_1@", single)
    assert re.search(r"(?m)^# node: ", single)


# --- the guide's SQL on a real server ---------------------------------------------------


def sql_blocks() -> list[str]:
    return re.findall(r"```sql\n(.*?)\n```", section_7(), re.S)


def statements(block: str) -> list[str]:
    return [s.strip() for s in re.split(r";\s*(?:\n|$)", block) if s.strip()]


def url_as(role: str, database: str) -> str:
    u = urlsplit(pg_helpers.ADMIN_URL)
    host = u.netloc.rpartition("@")[2]
    return urlunsplit((u.scheme, f"{role}@{host}", f"/{database}", "", ""))


def admin(database: str | None, sql: list[str]) -> None:
    url = pg_helpers.ADMIN_URL if database is None else pg_helpers.database_url(database)
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        for statement in sql:
            conn.execute(statement.encode())


async def daemon_works(url: str, password_file: Path, node: str) -> int:
    """What a daemon of site lab-1 does with the database: open (migrate), claim the
    leadership, commit with the fence, acknowledge, release. Returns the epoch."""
    store = PgStateStore(url, site="lab-1", password_file=password_file)
    await store.open()
    ha = Leadership(store, site="lab-1", node=node, boot_id=str(uuid.uuid4()), seconds=3)
    try:
        async with asyncio.timeout(10):
            epoch = await ha.acquire(asyncio.Event())
        assert epoch is not None
        store.epoch = epoch
        rows = await store.commit([], [OutboxRow("gpubroker/v1/status", b"{}")])
        await store.ack([r.id for r in rows if r.id is not None])
        assert await store.pending() == []
        status = await asyncio.to_thread(site_status, store, "lab-1")
        assert (status.leader, status.epoch) == (node, epoch)
        await ha.release()
        return epoch
    finally:
        await ha.close()
        await store.close()


async def test_the_guides_sql_gives_the_daemon_what_it_needs(tmp_path: Path) -> None:
    if (why := pg_helpers.available()) is not None:
        pytest.fail(why, pytrace=False)
    owner_block, daemon_block = sql_blocks()
    name = f"gpbdoc_{uuid.uuid4().hex[:10]}"
    password = uuid.uuid4().hex
    password_file = tmp_path / "postgresql"
    password_file.write_text(password + "\n")
    sql = [s.replace("gpubroker_lab_1", name) for s in statements(owner_block)]
    assert sql[:2] == [f"CREATE ROLE {name} LOGIN", f"CREATE DATABASE {name} OWNER {name}"]
    try:
        admin(None, [*sql, f"ALTER ROLE {name} PASSWORD '{password}'"])
        # The first start, as the database's owner: the tables are created.
        assert await daemon_works(url_as(name, name), password_file, "broker-a") == 1

        worker = f"{name}_daemon"
        admin(name, [s.replace("gpubroker_lab_1", name) for s in statements(daemon_block)]
              + [f"ALTER ROLE {worker} PASSWORD '{password}'"])
        assert await daemon_works(url_as(worker, name), password_file, "broker-b") == 2
        with psycopg.connect(url_as(worker, name), password=password, autocommit=True,
                             connect_timeout=5) as conn, \
                pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("CREATE TABLE sneaky (x INTEGER)")
        # Nobody else may connect.
        admin(None, [f"CREATE ROLE {name}_other LOGIN PASSWORD '{password}'"])
        with pytest.raises(psycopg.OperationalError, match="permission denied"):
            psycopg.connect(url_as(f"{name}_other", name), password=password,
                            connect_timeout=5).close()
    finally:
        admin(None, [f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)',
                     f"DROP ROLE IF EXISTS {name}_other", f"DROP ROLE IF EXISTS {name}_daemon",
                     f"DROP ROLE IF EXISTS {name}"])
