"""`gpubroker place`, `leases`, `release`, `renew` and `report`: the scheduler commands
(over gpubroker_client).

A person's view of what a scheduler does through `broker.client`: connection settings
from --config (the daemon's file: mqtt url, prefix, credentials) or --mqtt; one line per
error, no traceback; exit 1 for what the daemon or the network refused, 2 for what was
wrong in the command itself."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker.cli.common import EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, usage
from broker.daemon.config import load_config
from broker.output.stdio import printable

if TYPE_CHECKING:
    import gpubroker_client as client

MAX_TIMEOUT_SECONDS = 86400.0
"""The longest `--timeout`: a day."""


def seconds_arg(text: str) -> float:
    """`--timeout`: a number of seconds, finite, > 0 and at most MAX_TIMEOUT_SECONDS
    (`-1`, `nan` and `inf` were taken before and waited not at all, or for ever)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds, got {printable(repr(text), 80)}") from None
    if not 0 < value <= MAX_TIMEOUT_SECONDS:
        raise argparse.ArgumentTypeError(
            f"must be > 0 and at most {MAX_TIMEOUT_SECONDS:g} seconds "
            f"(MAX_TIMEOUT_SECONDS), got {printable(repr(text), 80)}")
    return value


def add_parsers(sub: Any) -> None:
    def connection(p: argparse.ArgumentParser) -> None:
        p.add_argument("--mqtt", metavar="URL",
                       help="MQTT server: mqtt://HOST[:PORT] or mqtts://HOST[:PORT] "
                            "(default: mqtt.url of --config, else mqtt://127.0.0.1:1883)")
        p.add_argument("--config", type=Path, metavar="PATH",
                       help="the daemon's configuration file, for its MQTT URL, topic "
                            "prefix and credentials")
        p.add_argument("--topic-prefix", metavar="PREFIX",
                       help="topic root (default: mqtt.topic_prefix of --config, else "
                            "gpubroker/v1)")
        p.add_argument("--timeout", type=seconds_arg, default=30.0, metavar="SECONDS",
                       help="how long to wait for the MQTT server and the daemon's answer "
                            "(default: 30)")

    scheduler_help = ("scheduler id S, the identity the daemon knows the lease by (default: "
                      "$GPUBROKER_SCHEDULER, else the MQTT username of --config, else 'cli')")
    place = sub.add_parser("place", help="ask the daemon for GPUs and print the lease",
                           description="Send a placement request as scheduler S (on "
                                       "P/requests/S/place) and print the decision. The "
                                       "lease expires after its lease period unless its "
                                       "scheduler renews it.")
    place.add_argument("--gpu", action="extend", nargs="+", required=True, metavar="MODEL",
                       help="acceptable GPU model(s), e.g. H100-80GB A100-80GB "
                            "(repeatable)")
    place.add_argument("--gpus", type=int, required=True, metavar="N",
                       help="GPUs wanted in all")
    place.add_argument("--market", choices=["spot", "on_demand", "reserved", "any"],
                       help="market (default: the policy's)")
    place.add_argument("--max-price", type=float, metavar="USD",
                       help="highest acceptable price per GPU-hour, in USD")
    place.add_argument("--cloud", action="extend", nargs="+", metavar="CLOUD",
                       help="only these clouds (repeatable)")
    place.add_argument("--region", action="extend", nargs="+", metavar="REGION",
                       help="only these regions (repeatable)")
    place.add_argument("--team", help="the team the GPUs are charged to (policy limits)")
    place.add_argument("--lease-seconds", type=int, metavar="SECONDS",
                       help="lease period before it must be renewed (default: the policy's)")
    place.add_argument("--duration-hours", type=float, metavar="HOURS",
                       help="how long the job expects to run (placement weighs it)")
    place.add_argument("--max-parts", type=int, metavar="N",
                       help="allow a split into up to N leases, one per pool, when no one "
                            "pool has room or the split is cheaper (sends gang: false)")
    place.add_argument("--label", action="append", metavar="KEY=VALUE",
                       help="a label kept with the lease (repeatable)")
    place.add_argument("--request-id", metavar="ID",
                       help="idempotency key: the same id always gets the same lease "
                            "(default: a new uuid, printed)")
    place.add_argument("--scheduler", metavar="S", help=scheduler_help)
    place.add_argument("--format", choices=["table", "json"], default="table",
                       help="table: for people; json: the decision's data on one line")
    connection(place)

    leases = sub.add_parser(
        "leases", help="list leases (and follow them with --watch)",
        description="List leases: from the daemon's HTTP API (GET /v1/leases) when --http "
                    "is given or --config sets http.listen, else from the retained "
                    "P/leases/S/<id> topics on MQTT, which hold the active leases only. "
                    "--watch lists the active leases, then follows every change on MQTT.")
    leases.add_argument("--scheduler", metavar="S",
                        help="only this scheduler's leases (default: every scheduler's)")
    leases.add_argument("--state", choices=["active", "released", "expired", "failed", "all"],
                        default="active",
                        help="which leases (default: active; others need the HTTP API)")
    leases.add_argument("--watch", action="store_true",
                        help="after the list, print each change as it happens, until Ctrl-C")
    leases.add_argument("--http", metavar="URL",
                        help="the daemon's HTTP API, http://HOST:PORT or HOST:PORT "
                             "(default: http.listen of --config, when it sets it)")
    leases.add_argument("--format", choices=["table", "json"], default="table",
                        help="table: for people; json: JSON Lines, one lease (with --watch: "
                             "one change) per line")
    connection(leases)

    release = sub.add_parser("release", help="release a lease",
                             description="Release a lease of scheduler S; a lease that has "
                                         "already ended is reported as such (exit 0).")
    release.add_argument("lease_id", metavar="LEASE_ID", help="the lease, e.g. L-8c1f…")
    release.add_argument("--scheduler", metavar="S", help=scheduler_help)
    connection(release)

    renew = sub.add_parser("renew", help="renew a lease",
                           description="Renew a lease of scheduler S by its lease period; "
                                       "prints the new expiry. A lease that has ended "
                                       "cannot be renewed (exit 1).")
    renew.add_argument("lease_id", metavar="LEASE_ID", help="the lease, e.g. L-8c1f…")
    renew.add_argument("--scheduler", metavar="S", help=scheduler_help)
    connection(renew)

    report = sub.add_parser("report", help="report that a lease's placement does not work",
                            description="Tell the daemon the capacity of a lease of "
                                        "scheduler S fails (P/requests/S/report): it moves "
                                        "the lease elsewhere and prints where (exit 0), or "
                                        "says why not (exit 1).")
    report.add_argument("lease_id", metavar="LEASE_ID", help="the lease, e.g. L-8c1f…")
    report.add_argument("--kind", required=True,
                        choices=["interrupted", "launch_failed", "unhealthy"],
                        help="what failed")
    report.add_argument("--detail", metavar="TEXT", help="what the cloud said, for people")
    report.add_argument("--epoch", type=int, metavar="N",
                        help="the epoch the report is about: a lease that has moved on "
                             "from it is left alone (default: its current epoch)")
    report.add_argument("--scheduler", metavar="S", help=scheduler_help)
    connection(report)


def client_command(args: argparse.Namespace) -> int:
    from gpubroker_client import BrokerError

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("gpubroker: %(message)s"))
    client_log = logging.getLogger("gpubroker.client")
    client_log.handlers[:] = [handler]
    client_log.propagate = False
    client_log.setLevel(logging.WARNING)
    try:
        if args.command == "place":
            return _place(args)
        if args.command == "release":
            return _release(args)
        if args.command == "renew":
            return _renew(args)
        if args.command == "report":
            return _report(args)
        return _leases(args)
    except ValueError as err:  # a bad URL, scheduler id or prefix
        return usage(str(err))
    except BrokerError as err:  # the MQTT server or the daemon said no, or nothing
        print(f"gpubroker: {printable(err)}", file=sys.stderr)
        return EXIT_RUNTIME


def _client_settings(args: argparse.Namespace, scheduler: str | None) -> dict[str, Any]:
    """BrokerClient arguments from --config, --mqtt and --topic-prefix."""
    import os

    from gpubroker_client import DEFAULT_PREFIX

    cfg = load_config(args.config) if args.config is not None else None
    mqtt = cfg.mqtt if cfg is not None else None
    settings: dict[str, Any] = {
        "url": args.mqtt or (mqtt.url if mqtt else "mqtt://127.0.0.1:1883"),
        "topic_prefix": args.topic_prefix or (mqtt.topic_prefix if mqtt else DEFAULT_PREFIX),
        "connect_timeout": max(1.0, min(args.timeout, 5.0)),
        # A command is one connection: a session kept after it would serve nobody (and
        # a 3.1.1 server keeps one until its own expiry setting).
        "persistent": False,
    }
    if mqtt is not None:
        settings.update(username=mqtt.username, password_file=mqtt.password_file,
                        ca_file=mqtt.ca_file, protocol=mqtt.protocol)
    if scheduler is None:
        scheduler = os.environ.get("GPUBROKER_SCHEDULER") or \
            (mqtt.username if mqtt and mqtt.username else None) or "cli"
    settings["scheduler"] = scheduler
    return settings


def _place(args: argparse.Namespace) -> int:
    import uuid

    from gpubroker_client import BrokerClient, InvalidRequest, PlacementTimeout, Rejected

    labels: dict[str, str] = {}
    for item in args.label or ():
        key, eq, value = item.partition("=")
        if not eq or not key:
            print(f"gpubroker: --label {item!r}: expected KEY=VALUE", file=sys.stderr)
            return EXIT_USAGE
        labels[key] = value
    rid = args.request_id or str(uuid.uuid4())
    settings = _client_settings(args, args.scheduler)

    async def go() -> client.Lease:
        async with BrokerClient(**settings) as c:
            return await c.place(
                gpu=args.gpu if len(args.gpu) > 1 else args.gpu[0], gpus=args.gpus,
                market=args.market, request_id=rid, timeout=args.timeout,
                max_price_per_gpu_hour=args.max_price, clouds=args.cloud,
                regions=args.region, team=args.team, lease_seconds=args.lease_seconds,
                duration_hours=args.duration_hours, labels=labels or None,
                **({"gang": False, "max_parts": args.max_parts}
                   if args.max_parts and args.max_parts > 1 else {}))

    again = f"; ask again with --request-id {rid} (the same id cannot place twice)"
    try:
        lease = asyncio.run(go())
    except Rejected as err:
        if args.format == "json" and err.event is not None:
            print(json.dumps(err.event["data"], separators=(",", ":")))
        print(f"gpubroker: request {rid} rejected: {err}", file=sys.stderr)
        return EXIT_RUNTIME
    except InvalidRequest as err:
        for e in err.errors:
            print(f"gpubroker: invalid request: {e['field'] or '(request)'}: {e['message']}",
                  file=sys.stderr)
        return EXIT_USAGE
    except PlacementTimeout as err:
        print(f"gpubroker: {err}{again}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        print(f"gpubroker: interrupted; the request may have been placed{again}",
              file=sys.stderr)
        return EXIT_RUNTIME
    if args.format == "json":
        print(json.dumps(dict(lease.decided), separators=(",", ":")))
        return EXIT_OK
    _print_placed(lease)
    return EXIT_OK


def _print_placed(lease: client.Lease) -> None:
    """The lease (each part of a split one), for people."""
    if len(lease.parts) > 1:
        print(f"request {lease.request_id} split into {len(lease.parts)} leases, one per "
              f"pool; each is renewed and released on its own")
    for n, part in enumerate(lease.parts):
        p = part.placement
        if part.active:
            print(f"placed {part.lease_id} for request {part.request_id} "
                  f"(scheduler {part.scheduler}, epoch {part.epoch})")
        else:
            print(f"request {part.request_id} already had lease {part.lease_id}, which has "
                  f"{part.state.value} (scheduler {part.scheduler}, epoch {part.epoch})")
        for name, value in (
                ("where", f"{p.pool.cloud} {p.pool.region}, zone {p.pool.zone}, "
                          f"{p.pool.instance_type}, {p.pool.market.value}"),
                ("launch", ", ".join(f"{n} into {t}" if n > 1 else t for t, n in p.targets)),
                ("gpus", f"{_instances(p.instances, p.gpus, p.gpu)} = {p.total_gpus} GPUs"),
                ("price", f"${p.price_per_gpu_hour:.4f} per GPU-hour, "
                          f"${p.price_per_hour:.2f} per hour"),
                ("expires", _expiry(part.expires_at.isoformat(), part.active)
                 + (" unless its scheduler renews it" if part.active else "")),
                ("why", lease.reason if n == 0 else "")):
            if value:
                print(f"  {name + ':':9}{value}")


def _instances(instances: int, gpus: int, gpu: str) -> str:
    """`2 instances × 8 A100-80GB`: never `16×A100-80GB`, which reads as one machine."""
    return f"{instances} instance{'s' if instances != 1 else ''} × {gpus} {gpu}"


def _expiry(expires_at: str, active: bool = True, *, short: bool = False) -> str:
    """`2026-12-01 22:36:12 UTC (in 14m 53s)`; short: `in 14m 53s`."""
    from broker.model import parse_iso, utcnow

    when = parse_iso(expires_at)
    left = int((when - utcnow()).total_seconds())
    m, s = divmod(max(0, left), 60)
    h, m = divmod(m, 60)
    rel = f"in {f'{h}h ' if h else ''}{f'{m}m ' if h or m else ''}{s}s" if left > 0 \
        else "due now"
    if short:
        return rel if active else "-"
    text = when.strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"{text} ({rel})" if active else text


def _release(args: argparse.Namespace) -> int:
    from broker.model import LeaseState
    from gpubroker_client import BrokerClient, InvalidRequest

    settings = _client_settings(args, args.scheduler)

    async def go() -> LeaseState:
        async with BrokerClient(**settings) as c:
            return await c.release(args.lease_id, timeout=args.timeout)

    try:
        state = asyncio.run(go())
    except InvalidRequest:
        return _no_lease(settings, args.lease_id)
    if state is LeaseState.RELEASED:
        print(f"released {args.lease_id}")
    else:
        print(f"{args.lease_id} had already {state.value}")
    return EXIT_OK


def _no_lease(settings: dict[str, Any], lease_id: str) -> int:
    print(f"gpubroker: scheduler {settings['scheduler']} has no lease {lease_id} "
          "(another scheduler's? give its --scheduler)", file=sys.stderr)
    return EXIT_RUNTIME


def _renew(args: argparse.Namespace) -> int:
    from datetime import datetime

    from gpubroker_client import BrokerClient, InvalidRequest, LeaseEnded

    settings = _client_settings(args, args.scheduler)

    async def go() -> datetime:
        async with BrokerClient(**settings) as c:
            return await c.renew(args.lease_id, timeout=args.timeout)

    try:
        expires = asyncio.run(go())
    except InvalidRequest as err:
        if "lease_id" in err.fields:
            return _no_lease(settings, args.lease_id)
        raise
    except LeaseEnded as err:
        print(f"gpubroker: {args.lease_id} has {err.state.value}; it cannot be renewed",
              file=sys.stderr)
        return EXIT_RUNTIME
    print(f"renewed {args.lease_id}; expires {_expiry(expires.isoformat())}")
    return EXIT_OK


def _report(args: argparse.Namespace) -> int:
    from gpubroker_client import (
        BrokerClient,
        InvalidRequest,
        LeaseEnded,
        LeaseEvent,
        ReportDeclined,
        StaleEpoch,
    )

    settings = _client_settings(args, args.scheduler)

    async def go() -> LeaseEvent:
        async with BrokerClient(**settings) as c:
            return await c.report(args.lease_id, args.kind, args.detail, epoch=args.epoch,
                                  timeout=args.timeout)

    try:
        ev = asyncio.run(go())
    except InvalidRequest as err:
        if "lease_id" in err.fields:
            return _no_lease(settings, args.lease_id)
        for e in err.errors:
            print(f"gpubroker: invalid request: {e['field'] or '(request)'}: {e['message']}",
                  file=sys.stderr)
        return EXIT_RUNTIME
    except StaleEpoch as err:  # what the report asked for has happened already
        print(f"{args.lease_id} has moved on from epoch {args.epoch} already (now epoch "
              f"{err.epoch}); nothing done")
        return EXIT_OK
    except (LeaseEnded, ReportDeclined) as err:
        print(f"gpubroker: {printable(err)}", file=sys.stderr)
        return EXIT_RUNTIME
    p = ev.placement
    print(f"moved {args.lease_id} to epoch {ev.epoch}: {_instances(p.instances, p.gpus, p.gpu)}"
          f" {p.pool.cloud}/{p.pool.zone} {p.pool.instance_type} {p.pool.market.value}"
          + (f" ({ev.reason})" if ev.reason else ""))
    return EXIT_OK


def _leases(args: argparse.Namespace) -> int:
    http = args.http
    if http is None and not args.watch and args.config is not None:
        cfg = load_config(args.config)
        if "listen" in cfg.http.model_fields_set and cfg.http.listen is not None:
            http = cfg.http.listen
    if http is not None and not args.watch:
        return _leases_http(args, http)
    if args.state != "active":
        print(f"gpubroker: MQTT holds the active leases only; --state {args.state} needs the "
              "daemon's HTTP API (--http, or http.listen in --config)"
              + (" and cannot be watched" if args.watch else ""), file=sys.stderr)
        return EXIT_USAGE
    return _leases_mqtt(args)


def _leases_http(args: argparse.Namespace, base: str) -> int:
    import urllib.error
    import urllib.parse
    import urllib.request

    if "://" not in base:
        base = "http://" + base
    states = ["active", "released", "expired", "failed"] if args.state == "all" \
        else [args.state]
    rows: list[dict[str, Any]] = []
    for state in states:
        query = {"state": state, **({"scheduler": args.scheduler} if args.scheduler else {})}
        url = f"{base.rstrip('/')}/v1/leases?{urllib.parse.urlencode(query)}"
        try:
            with urllib.request.urlopen(url, timeout=args.timeout) as answer:
                rows += json.loads(answer.read())
        except urllib.error.HTTPError as err:
            print(f"gpubroker: {url}: HTTP {err.code}: {err.read().decode(errors='replace')}",
                  file=sys.stderr)
            return EXIT_RUNTIME
        except (urllib.error.URLError, OSError, ValueError) as err:
            why = getattr(err, "reason", err)
            print(f"gpubroker: cannot read the daemon's HTTP API at {base}: {why}",
                  file=sys.stderr)
            return EXIT_RUNTIME
    rows.sort(key=lambda le: str(le.get("created_at", "")))
    _print_leases(rows, args.format)
    return EXIT_OK


def _targets(p: dict[str, Any], most: int = 4) -> str:
    """` on gpu-a01, gpu-a02` (reservations or private servers to launch into)."""
    targets = p.get("targets") or ()
    if not targets:
        return ""
    names = [t["id"] if t["instances"] == 1 else f"{t['id']}×{t['instances']}"
             for t in targets[:most]]
    more = f" +{len(targets) - most}" if len(targets) > most else ""
    return f" on {', '.join(names)}{more}"


def _print_leases(rows: Sequence[dict[str, Any]], fmt: str) -> None:
    if fmt == "json":
        for le in rows:
            print(json.dumps(le, separators=(",", ":")))
        return
    table = [("LEASE", "SCHEDULER", "REQUEST", "STATE", "EPOCH", "INSTANCES × GPUS", "WHERE",
              "$/GPU-H", "$/H", "EXPIRES")]
    for le in rows:
        p = le["placement"]
        table.append((le["lease_id"], le["scheduler"], le["request_id"], le["state"],
                      str(le["epoch"]), f"{p['instances']} × {p['gpus']} {p['gpu']}",
                      f"{p['cloud']}/{p['zone']} {p['instance_type']} {p['market']}"
                      + _targets(p),
                      f"{p['price_per_gpu_hour']:.4f}", f"{p['price_per_hour']:.2f}",
                      _expiry(le["expires_at"], le["state"] == "active", short=True)))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        print("  ".join(c.rjust(w) if i in (4, 7, 8) else c.ljust(w)
                        for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())
    print(f"{len(rows)} lease{'s' if len(rows) != 1 else ''}")


def _leases_mqtt(args: argparse.Namespace) -> int:
    import signal

    from gpubroker_client import BrokerClient, LeaseChange

    settings = _client_settings(args, None)
    settings["scheduler"] = None  # read only: a lease watch

    def line(change: LeaseChange) -> str:
        from broker.model import iso, utcnow

        if args.format == "json":
            out: dict[str, Any] = {"change": change.kind, "lease_id": change.lease_id,
                                   "scheduler": change.scheduler, "time": iso(utcnow()),
                                   "lease": change.state}
            if change.reason is not None:
                out.update(reason=change.reason, detail=change.detail)
            return json.dumps(out, separators=(",", ":"))
        t = utcnow().strftime("%H:%M:%S")
        head = f"{t} {change.kind.upper():<8} {change.lease_id} {change.scheduler}"
        s = change.state or {}
        p = s.get("placement")
        if change.kind in ("placed", "failover") and p:
            why = f" ({change.reason})" if change.reason else ""
            lead = f"epoch {s.get('epoch')}{why} → " if change.kind == "failover" else ""
            return (f"{head} {lead}{p['instances']} × {p['gpus']} {p['gpu']} {p['cloud']}/"
                    f"{p['zone']} {p['instance_type']} {p['market']}{_targets(p)} "
                    f"${p['price_per_gpu_hour']:.4f}/GPU-h, expires "
                    f"{s['expires_at'][11:19]}")
        if change.kind == "renewed":
            return f"{head} expires {s.get('expires_at', '')[11:19]}"
        detail = f" {change.reason}: {change.detail}" if change.reason else ""
        return head + detail

    async def go() -> None:
        async with BrokerClient(**settings) as c, c.watch_leases(
                args.scheduler, all_schedulers=args.scheduler is None) as watch:
            await watch.synced(args.timeout)
            rows = sorted(watch.states.values(), key=lambda le: str(le.get("created_at")))
            if args.watch and args.format == "json":
                for le in rows:
                    print(json.dumps({"change": "present", "lease_id": le["lease_id"],
                                      "scheduler": le["scheduler"], "lease": le},
                                     separators=(",", ":")))
            else:
                _print_leases(rows, args.format)
            if not args.watch:
                return
            sys.stdout.flush()
            print("watching for changes; Ctrl-C to stop", file=sys.stderr)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            stopping = asyncio.create_task(stop.wait())
            changes = watch.changes()
            while True:
                nxt = asyncio.ensure_future(anext(changes))
                await asyncio.wait({nxt, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    return
                print(line(nxt.result()), flush=True)

    try:
        asyncio.run(go())
    except BrokenPipeError:  # `gpubroker leases --watch | head`: the reader has had enough
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_OK
