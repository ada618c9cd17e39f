"""`gpubroker policy check|explain|diff` and `gpubroker private check`: the ops teams'
files, checked and tried against the market and the leases."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker.cli.common import EXIT_OK, EXIT_USAGE, config_at, gpu_typo, poll_once, quiet_logs, usage
from broker.output.stdio import printable

if TYPE_CHECKING:
    from broker.model import Lease


def policy_explain(args: argparse.Namespace) -> int:
    from broker.model import CLOUDS, utcnow
    from broker.placement.optimizer import Ask, explain
    from broker.wire import validation
    from policies.loader import load_policy

    policy = load_policy(args.file)
    req = validation.parse_place(args.scheduler, args.request.encode())
    if isinstance(req, validation.Invalid):
        for fe in req.errors:
            print(f"gpubroker: --request: {fe['field'] or '(body)'}: {fe['message']}",
                  file=sys.stderr)
        return EXIT_USAGE
    # A name the daemon would take but that is most likely a typo here: a team the
    # policy does not have (the daemon gives it no limits), a cloud no adapter has.
    if req.team is not None and policy.teams and req.team not in policy.teams:
        return usage(f"--request: team: {validation.unknown_name('team', req.team, policy.teams)}")
    for name in req.clouds or ():
        if name not in CLOUDS:
            return usage(f"--request: clouds: {validation.unknown_name('cloud', name, CLOUDS)}")
    if typo := gpu_typo("--request: gpu", req.gpu):
        return usage(typo)
    cfg = config_at(args.config)
    quiet_logs()
    pool, _ = poll_once(cfg)
    unknown = validation.unknown_gpus(req, lambda: set(policy.extra_gpus) | pool.gpus())
    if unknown is not None:
        return usage(f"--request: gpu: {unknown.errors[0]['message']}")
    report = explain(Ask(req), pool, policy, now=utcnow(), all_gpus=sorted(pool.gpus()))
    if args.format == "json":
        print(json.dumps(report, indent=2))
        return EXIT_OK
    verdict = report["verdict"]
    print(f"request {req.request_id}: {req.gpus}×{'|'.join(req.gpu)}")
    if "denied" in verdict:
        print(f"  denied ({verdict['denied']}): {verdict['detail']}")
        return EXIT_OK
    print(f"  rule: {verdict['rule'] or '(no rule matched)'}")
    for k in ("gpus", "markets", "max_price_per_gpu_hour", "clouds", "regions", "residency",
              "budget_left_per_hour", "risk"):
        if verdict.get(k) is not None:
            print(f"  {k}: {verdict[k]}")
    print(f"  offers excluded ({sum(report['excluded'].values())}):")
    for why, n in report["excluded"].items():
        print(f"    {n:6d}  {why}")
    print(f"  feasible offers: {report['feasible']}; best {len(report['candidates'])}:")
    for c in report["candidates"]:
        p, t = c["placement"], c["terms"]
        print(f"    ${c['expected_cost_per_hour']:.4f}/h expected = ${c['price_per_hour']:.4f}/h"
              f" × (1 + {t['interruption']:.3f} interruption + {t['availability']:.3f} "
              f"availability + {t['spread']:.3f} spread)  {p['instances']}× "
              f"{p['cloud']}/{p['zone']} {p['instance_type']} {p['market']}")
    return EXIT_OK


def policy_diff(args: argparse.Namespace) -> int:
    from broker.leasing import failover
    from broker.model import LeaseState, utcnow
    from broker.placement.optimizer import Decision
    from broker.state.configured import store_for
    from broker.state.store import StoreFailed, db_errors
    from policies.evaluate import forbids
    from policies.loader import load_policy
    from policies.residency import Residency

    old, new = load_policy(args.old), load_policy(args.new)
    cfg = config_at(args.config)
    quiet_logs()

    store = store_for(cfg.state, cfg.site, read_only=True)  # the daemon may be running

    async def active() -> list[Lease]:
        await store.open()
        try:
            return [le for le in await store.leases() if le.state is LeaseState.ACTIVE]
        finally:
            await store.close()

    if not cfg.state.url and not cfg.state.path.is_file():
        return usage(f"no state file at {cfg.state.path}"
                      + (" (a directory)" if cfg.state.path.is_dir() else ""))
    try:
        leases = asyncio.run(active())
    except db_errors(StoreFailed, RuntimeError) as err:  # not a state, or a newer one's
        what = "database" if cfg.state.url else "state file"
        return usage(f"{store.name}: cannot read the {what}: {str(err).strip()}")
    pool, _ = poll_once(cfg)
    for lease in leases:
        pool.hold(lease.placement.pool, lease.placement.instances)
    resident_old, resident_new = Residency(old.residency.tags), Residency(new.residency.tags)
    now = utcnow()
    rows = []
    for lease in leases:
        p = lease.placement
        why_new = forbids(new, lease.request, p.pool, p.gpu, p.price_per_gpu_hour, resident_new)
        if not why_new:
            continue
        why_old = forbids(old, lease.request, p.pool, p.gpu, p.price_per_gpu_hour, resident_old)
        pool.unhold(p.pool, p.instances)
        outcome = failover.replacement(lease, pool, new, resident_new, now)
        pool.hold(p.pool, p.instances)
        row: dict[str, Any] = {"lease_id": lease.lease_id, "scheduler": lease.scheduler,
               "team": lease.request.team, "from": p.to_json(), "why": why_new,
               "forbidden_already": bool(why_old)}
        if isinstance(outcome, Decision):
            row.update(outcome="moves", to=outcome.placement.to_json())
        else:
            row.update(outcome="fails", detail=outcome.detail)
        rows.append(row)
    if args.format == "json":
        print(json.dumps({"active_leases": len(leases), "affected": rows}, indent=2))
        return EXIT_OK
    print(f"{len(leases)} active leases; {len(rows)} forbidden under {args.new}:")
    for r in rows:
        f = r["from"]
        where = f"{f['cloud']}/{f['zone']} {f['instance_type']} {f['market']}"
        if r["outcome"] == "moves":
            t = r["to"]
            to = f"moves to {t['cloud']}/{t['zone']} {t['instance_type']} {t['market']}"
        else:
            to = f"FAILS: {r['detail']}"
        note = " (already forbidden under the old policy)" if r["forbidden_already"] else ""
        print(f"  {r['lease_id']} {r['scheduler']}/{r['team'] or '-'} on {where}: {r['why']};"
              f" {to}{note}")
    return EXIT_OK


def policy_check(path: Path) -> int:
    from policies.loader import load_policy

    policy = load_policy(path)
    print(f"{printable(str(path))}: ok (version {policy.version})")
    return EXIT_OK


def private_check(path: Path) -> int:
    from adapters.private.servers import load_servers

    servers = load_servers(path)  # raises SourceError: every problem, by line
    print(f"{printable(str(path))}: ok: {len(servers.sites)} sites, {len(servers.groups)} groups, "
          f"{servers.server_count} servers")
    return EXIT_OK
