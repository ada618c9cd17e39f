"""The store a configuration names: SQLite or PostgreSQL. Apart from both stores'
modules, which it imports, so that neither imports the other to be chosen."""

from __future__ import annotations

from broker.daemon.config import StateConfig
from broker.state.pgstore import PgStateStore
from broker.state.store import StateStore, Store


def store_for(state: StateConfig, site: str, *, read_only: bool = False) -> Store:
    """The store the configuration's `state` section names: PostgreSQL when `url` is
    set (high availability), else the SQLite file at `path`. `read_only`: for commands
    that only read, next to a running daemon (SQLite: no lock taken, no schema change)."""
    if state.url:
        return PgStateStore(state.url, site=site, password_file=state.password_file,
                            leadership_seconds=state.leadership_seconds)
    return StateStore(state.path, synchronous=state.synchronous, read_only=read_only)
