"""`gpubroker offers`: poll once and list the pool by price per GPU-hour."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from broker.cli.common import (
    EXIT_OK,
    EXIT_RUNTIME,
    config_at,
    gpu_typo,
    poll_once,
    quiet_logs,
    usage,
)

if TYPE_CHECKING:
    from broker.model import Offer


def list_offers(args: argparse.Namespace) -> int:
    from broker.model import CLOUDS, GPU_MODELS
    from broker.wire.validation import unknown_gpu, unknown_name

    for name in args.cloud or ():
        if name not in CLOUDS:
            return usage(f"--cloud: {unknown_name('cloud', name, CLOUDS)}")
    if typo := gpu_typo("--gpu", args.gpu):
        return usage(typo)
    cfg = config_at(args.config)
    quiet_logs()
    pool, errors = poll_once(cfg)
    known = set(GPU_MODELS) | pool.gpus()
    for name in args.gpu or ():
        if name not in known:
            return usage(f"--gpu: {unknown_gpu(name, known)}")
    offers = [o for o in pool
              if (not args.gpu or o.gpu in args.gpu)
              and (not args.cloud or o.pool.cloud in args.cloud)
              and (not args.market or o.pool.market.value == args.market)]
    offers.sort(key=lambda o: (o.price_per_gpu_hour is None, o.price_per_gpu_hour or 0.0,
                               o.pool))
    out = sys.stdout
    if args.format == "json":
        for o in offers:
            out.write(json.dumps(o.to_json(), separators=(",", ":")) + "\n")
    else:
        _table(offers, out)
    if errors and not offers:
        return EXIT_RUNTIME
    return EXIT_OK


def _table(offers: Sequence[Offer], out: TextIO) -> None:
    rows = [("CLOUD", "REGION", "ZONE", "INSTANCE TYPE", "MARKET", "GPU", "GPUS", "$/H",
             "$/GPU-H", "AVAIL", "FREE", "INTR/H", "QUOTA")]

    def f(x: float | int | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for o in offers:
        rows.append((o.pool.cloud, o.pool.region, o.pool.zone, o.pool.instance_type,
                     o.pool.market.value, o.gpu + ("" if o.gpu_known else "?"), str(o.gpus),
                     f(o.price_per_hour, ".4f"), f(o.price_per_gpu_hour, ".4f"),
                     f(o.availability, ".2f"), f(o.capacity, "d"),
                     f(o.interruption_rate, ".3f"), f(o.quota_headroom, "d")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {6, 7, 8, 9, 10, 11, 12}
    for r in rows:
        line = "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        print(line.rstrip(), file=out)
    print(f"{len(offers)} offers", file=out)
    owned = [o for o in offers if o.targets]
    if owned:
        free = sum((o.capacity or 0) * o.gpus for o in owned)
        print(f"paid-for capacity (market reserved): {sum(o.owned_gpus for o in owned)} GPUs "
              f"in {len(owned)} pools, {free} free now (idle unless a lease is about to use "
              "them)", file=out)
