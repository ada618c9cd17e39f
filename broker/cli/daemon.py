"""`gpubroker run` and `gpubroker status`: the daemon in the foreground, and the site's
leader and nodes (high availability)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import sys
from typing import TYPE_CHECKING, Any

from broker.cli.common import EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, config_at, error_line, usage

if TYPE_CHECKING:
    from broker.daemon.config import Config
    from broker.state.sitestatus import SiteStatus


def run_daemon(args: argparse.Namespace) -> int:
    import structlog

    from broker.daemon.assembly import Daemon, install_signal_handlers
    from broker.output import logs
    from broker.state.store import StoreFailed

    cfg = config_at(args.config)
    logs.configure(json=True, level=logging.getLevelNamesMapping()[cfg.log_level.upper()])
    daemon = Daemon(cfg)

    async def go() -> None:
        nonlocal daemon
        stop = asyncio.Event()
        while True:
            remove = install_signal_handlers(stop, daemon.request_reload)
            try:
                await daemon.run(stop)
                return
            except StoreFailed as exc:
                # Crash-only, SQLite: exit; systemd starts the daemon again. With high
                # availability the node steps down instead (another may lead by now) and
                # stands by again with a fresh start, which reloads the state.
                if not cfg.state.url or stop.is_set():
                    raise
                structlog.get_logger("gpubroker.daemon").warning(
                    "stepped down; standing by again", why=str(exc)[:300])
            finally:
                remove()
            daemon = Daemon(cfg)

    try:
        asyncio.run(go())
    except StoreFailed:
        # Crash-only (broker.leasing.authority): the broker has logged SQLite's error, once; systemd
        # starts the daemon again, and it recovers from the store.
        return EXIT_RUNTIME
    except (OSError, ExceptionGroup) as exc:
        first = exc.exceptions[0] if isinstance(exc, ExceptionGroup) else exc
        if isinstance(first, OSError):  # `http.listen HOST:PORT: address already in use`
            print(f"gpubroker: {error_line(first)}", file=sys.stderr)
            # A name that does not resolve is a mistake in the configuration; a port in
            # use may be free at the next start.
            return EXIT_USAGE if isinstance(first, socket.gaierror) else EXIT_RUNTIME
        print(f"gpubroker: {type(first).__name__}: {first}", file=sys.stderr)
        return EXIT_RUNTIME
    return EXIT_OK


def show_status(args: argparse.Namespace) -> int:
    """`gpubroker status`: the site's leadership and nodes as its PostgreSQL database has
    them (broker.state.leadership). A SQLite state is a single daemon: said so, exit 0.
    A database that
    cannot be reached or read: one line, exit 1; another site's database, an unreadable
    password file or no psycopg: exit 2, as the daemon would."""
    from broker.model import iso

    cfg = config_at(args.config)
    out: dict[str, Any] = {"site": cfg.site, "high_availability": bool(cfg.state.url),
                           "database": None, "leadership_seconds": None, "leader": None,
                           "epoch": 0, "claimed_by": None, "expires_in_seconds": None,
                           "nodes": []}
    if not cfg.state.url:
        out["database"] = str(cfg.state.path)
        if args.format == "json":
            print(json.dumps(out, indent=2))
        else:
            print(f"site {cfg.site}: state in the SQLite file {cfg.state.path}: a single "
                  "daemon, no high availability (set state.url to run several)")
        return EXIT_OK

    from broker.state.pgstore import PgStateStore
    from broker.state.sitestatus import site_status
    from broker.state.store import db_errors

    store = PgStateStore(cfg.state.url, site=cfg.site, password_file=cfg.state.password_file,
                         leadership_seconds=cfg.state.leadership_seconds)
    if (pw := cfg.state.password_file) is not None:
        from gpubroker_client.files import read_secret

        try:
            read_secret(pw)
        except OSError as err:
            return usage(f"{pw}: state.password_file: cannot read: {err.strerror or err}")

    def one_line(err: BaseException) -> str:
        return " ".join(str(err).split()) or type(err).__name__

    try:
        with store.connect() as conn:
            found = conn.execute("SELECT to_regclass('leadership') IS NOT NULL, "
                                 "to_regclass('meta') IS NOT NULL").fetchone()
            owner = None
            if found is not None and found[1]:
                row = conn.execute("SELECT value FROM meta WHERE key = 'site'").fetchone()
                owner = None if row is None else str(row[0])
        if owner is not None and owner != cfg.site:
            return usage(f"{store.name}: state.url: the database holds the state of site "
                          f"{owner!r}, not {cfg.site!r}: each site needs a database of its own")
        if found is None or not found[0]:
            print(f"gpubroker: {store.name}: no leadership in this database yet: no daemon "
                  f"of site {cfg.site} has started on it", file=sys.stderr)
            return EXIT_RUNTIME
        site = site_status(store, cfg.site)
    except RuntimeError as err:  # psycopg is not installed
        return usage(f"state.url: {err}")
    except db_errors(OSError) as err:
        print(f"gpubroker: {store.name}: cannot read the site's status: {one_line(err)}",
              file=sys.stderr)
        return EXIT_RUNTIME

    valid = site.leader is not None and (site.expires_in_seconds or 0.0) > 0
    out.update(database=store.name, leadership_seconds=cfg.state.leadership_seconds,
               leader=site.leader if valid else None, epoch=site.epoch,
               claimed_by=site.leader,
               expires_in_seconds=None if site.expires_in_seconds is None
               else round(site.expires_in_seconds, 3),
               nodes=[{"node": n.node, "role": n.role, "epoch": n.epoch, "boot_id": n.boot_id,
                       "version": n.version, "started_at": iso(n.started_at),
                       "seen_seconds_ago": round(max(0.0, n.seen_seconds_ago), 3)}
                      for n in site.nodes])
    if args.format == "json":
        print(json.dumps(out, indent=2))
        return EXIT_OK

    _print_site(cfg, store.name, site, valid=valid)
    return EXIT_OK


def _print_site(cfg: Config, database: str, site: SiteStatus, *, valid: bool) -> None:
    """The site's leadership and nodes, for people."""
    from datetime import UTC

    print(f"site {cfg.site} on {database} (leadership_seconds "
          f"{cfg.state.leadership_seconds:g})")
    if site.leader is None:
        print("leader: none yet: no node has led this site")
    elif valid:
        print(f"leader: node {site.leader}, epoch {site.epoch}; its claim expires in "
              f"{_ago(site.expires_in_seconds or 0.0)} unless renewed")
    else:
        print(f"leader: none: the claim of node {site.leader} (epoch {site.epoch}) expired "
              f"{_ago(-(site.expires_in_seconds or 0.0))} ago; a standby takes over at "
              "its next claim")
    rows = [("NODE", "ROLE", "EPOCH", "VERSION", "STARTED", "LAST SEEN")]
    rows += [(n.node, n.role, str(n.epoch), n.version,
              n.started_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
              f"{_ago(n.seen_seconds_ago)} ago") for n in site.nodes]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.rjust(w) if i == 2 else c.ljust(w)
                        for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())
    # A running node writes its heartbeat at least every leadership_seconds / 3.
    gone = [n for n in site.nodes
            if n.role != "stopped" and n.seen_seconds_ago > cfg.state.leadership_seconds + 1]
    for n in gone:
        print(f"node {n.node}: not seen for {_ago(n.seen_seconds_ago)}: stopped, or cut off "
              "from the database")
    print(f"{len(site.nodes)} node{'s' if len(site.nodes) != 1 else ''}")


def _ago(seconds: float) -> str:
    """`0.4 s`, `42.0 s`, `3m 5s`, `2h 10m`, `3d 4h`."""
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(s), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    if d:
        return f"{d}d {h}h"
    return f"{h}h {m}m" if h else f"{m}m {sec}s"
