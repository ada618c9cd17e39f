"""A real PostgreSQL for the tests: a fresh database per test, dropped afterwards.

The server is the one `GPUBROKER_TEST_PG` names (a libpq URL of a role that may create
databases), by default `postgresql://postgres@127.0.0.1:5432/postgres` — the local
server `.ci/run` installs and starts when it is missing. A server that does not answer
fails the test with what to do; it is never skipped.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

ADMIN_URL = os.environ.get("GPUBROKER_TEST_PG",
                           "postgresql://postgres@127.0.0.1:5432/postgres")
INSTALL_HINT = ("PostgreSQL is not reachable at " + ADMIN_URL + ": run .ci/run (it installs "
                "and starts it), or set GPUBROKER_TEST_PG to a role that may create databases")


def database_url(name: str) -> str:
    """`ADMIN_URL` with its database replaced by `name`."""
    u = urlsplit(ADMIN_URL)
    return urlunsplit((u.scheme, u.netloc, f"/{name}", u.query, u.fragment))


def _admin() -> object:
    import psycopg

    return psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=5)


def available() -> str | None:
    """None when the server answers; else why not."""
    try:
        with _admin():  # type: ignore[attr-defined]
            return None
    except Exception as exc:
        return f"{INSTALL_HINT} ({type(exc).__name__}: {str(exc).strip()[:200]})"


@contextlib.contextmanager
def fresh_database(prefix: str = "gpbtest") -> Iterator[str]:
    """Create an empty database; yield its URL; drop it (with any session left)."""
    import psycopg

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=5) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield database_url(name)
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=5) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
