"""A comparison as tables for people: one seed's (`write_table`) and several seeds' means
with their confidence intervals (`write_seeds_table`); with a private pool, its section."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from broker.backtest.compare import CONFIDENCE, PRIVATE_NOTE, Comparison, Seeds, private_headline
from broker.backtest.ledger import Settings

_COLUMNS = (
    ("STRATEGY", "strategy", "{}"),
    ("$/USEFUL GPU-H", "cost_per_useful_gpu_hour", "{:.4f}"),
    ("TOTAL $", "total_cost", "{:,.0f}"),
    ("USEFUL GPU-H", "useful_gpu_hours", "{:,.0f}"),
    ("LOST GPU-H", "lost_gpu_hours", "{:,.0f}"),
    ("SPOT", "spot_share", "{:.0%}"),
    ("INTR", "interruptions", "{}"),
    ("INTR/1K GPU-H", "interruptions_per_1000_gpu_hours", "{:.2f}"),
    ("FAILOVERS", "failovers", "{}"),
    ("NEVER PLACED", "never_placed", "{}"),
    ("MEAN WAIT H", "mean_wait_hours", "{:.2f}"),
)


def write_table(c: Comparison, out: TextIO) -> None:
    m, w = c.market.describe(), c.workload.describe()
    print(f"market {m['source']}: {m['start']} to {m['end']} ({m['hours']:g} h, "
          f"{m['pools']} pools, {m['rows']} rows)", file=out)
    print(f"workload {w['source']}: {w['requests']} requests, {w['gpu_hours_asked']:,.0f} "
          f"GPU-hours asked" + (f" ({w['left_out_after_market_end']} after the market's end "
                                "left out)" if w["left_out_after_market_end"] else ""),
          file=out)
    s = c.settings
    print(f"policy {c.policy}; {_seeds(s)}, step {s.step_seconds / 60:g} min, restart "
          f"{s.restart_hours:g} h, max wait {s.max_wait_hours:g} h", file=out)
    rows = [tuple(h for h, _, _ in _COLUMNS)]
    for r in c.results:
        d = r.metrics()
        rows.append(tuple("-" if d[k] is None else fmt.format(d[k]) for _, k, fmt in _COLUMNS))
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    print(file=out)
    for row in rows:
        print("  ".join(cell.ljust(wd) if i == 0 else cell.rjust(wd)
                        for i, (cell, wd) in enumerate(zip(row, widths, strict=True))),
              file=out)
    if c.private is not None:
        _private_table(c, [(m["strategy"], m["cloud_only"], private_headline(m))
                           for m in c.private_metrics()], _one, out)

_PRIVATE_COLUMNS = (("$/USEFUL GPU-H", "cost_per_useful_gpu_hour", "{:.4f}"),
                    ("INTR/1K GPU-H", "interruptions_per_1000_gpu_hours", "{:.2f}"),
                    ("UNPLACED", "unplaced", "{}"),
                    ("SAVED $", "saved", "{:,.0f}"),
                    ("SAVED $/USEFUL GPU-H", "saved_per_useful_gpu_hour", "{:.4f}"),
                    ("BUSY GPU-H", "busy_gpu_hours", "{:,.0f}"),
                    ("UTIL", "utilisation", "{:.1%}"))

_FIRST_THREE = 3  # the columns both runs have; the rest are the pool's

_WRAP = 100  # the private section's text lines


def _one(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _private_table(c: Comparison, rows: Sequence[tuple[str, dict[str, Any], dict[str, Any]]],
                   cell: Callable[[Any, str], str], out: TextIO) -> None:
    """Per strategy, a row cloud only and a row with the private pool: (strategy, the
    cloud-only figures, the hybrid figures) → cells by `cell(value, format)`; then the
    footer on money. Means (over seeds) of the unplaced requests get a decimal."""
    columns = [(h, k, "{:.1f}" if cell is _pm_cell and k == "unplaced" else fmt)
               for h, k, fmt in _PRIVATE_COLUMNS]
    site = c.private
    assert site is not None
    print(file=out)
    print(textwrap.fill(
        f"private pool: {site.gpus} × {site.gpu} as {site.servers} server"
        f"{'s' if site.servers != 1 else ''} of {site.per_server} GPUs"
        + (f" in {site.slices} slices" if site.slices > 1 else "") + f" ({site.owned_gpus} "
        f"GPUs) at {site.key.cloud}/{site.key.region}, ${site.price:g}/GPU-h to a lease on "
        f"it; {c.owned_gpu_hours():,.0f} owned GPU-hours over {c.market.hours:g} h. Every "
        f"strategy cloud only, then with the pool: same market, requests and draws.",
        _WRAP), file=out)
    table = [("STRATEGY", "RUN", *(h for h, _, _ in columns))]
    for name, cloud, hybrid in rows:
        table.append((name, "cloud only",
                      *(cell(cloud[k], fmt) for _, k, fmt in columns[:_FIRST_THREE]),
                      *("" for _ in columns[_FIRST_THREE:])))
        table.append(("", "+ private pool", *(cell(hybrid[k], fmt) for _, k, fmt in columns)))
    print(file=out)
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(text.ljust(wd) if i < 2 else text.rjust(wd)
                        for i, (text, wd) in enumerate(zip(row, widths, strict=True))
                        ).rstrip(), file=out)
    fixed = c.fixed_cost()
    print(file=out)
    print(textwrap.fill(
        "SAVED: cloud only − with the pool, in all and per useful GPU-hour (the difference "
        "of $/useful GPU-h); BUSY: GPU-hours leases held on the pool (whole servers); UTIL: "
        f"busy / owned. {PRIVATE_NOTE[0].upper()}{PRIVATE_NOTE[1:]}."
        + ("" if fixed is None else f" For reference, the pool's "
           f"{c.owned_gpu_hours():,.0f} GPU-hours at ${site.price:g}/GPU-h: ${fixed:,.0f} "
           "over the run."), _WRAP), file=out)


def _seeds(s: Settings) -> str:
    """Which seeds a run used: the draws' always; the market's and the workload's when
    generated (or, for a trace file, the zone labels' permutation)."""
    named = [f"draw seed {s.seed}"]
    if s.market_seed is not None:
        named.append(f"market seed {s.market_seed}")
    if s.workload_seed is not None:
        named.append(f"workload seed {s.workload_seed}")
    return ", ".join(named)


def _span(values: Sequence[int | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    if len(set(known)) == 1:
        return str(known[0])
    if known == list(range(known[0], known[0] + len(known))):
        return f"{known[0]}..{known[-1]}"
    return ",".join(str(v) for v in known)


def _pm(d: dict[str, Any], fmt: str) -> str:
    if d["mean"] is None:
        return "-"
    text = fmt.format(d["mean"])
    return text if d["half_width"] is None else f"{text} ± {fmt.format(d['half_width'])}"

_SUMMARY_COLUMNS = (("$/USEFUL GPU-H", "cost_per_useful_gpu_hour", "{:.4f}"),
                    ("INTR/1K GPU-H", "interruptions_per_1000_gpu_hours", "{:.2f}"),
                    ("UNPLACED", "unplaced", "{:.1f}"))


def write_seeds_table(seeds: Seeds, out: TextIO) -> None:
    """Per strategy, the mean ± the confidence interval's half-width over the seeds of
    $ per useful GPU-hour, interruptions per 1,000 useful GPU-hours and requests never
    placed or abandoned; then each seed's figures. One seed: `write_table`."""
    if len(seeds.runs) == 1:
        write_table(seeds.first, out)
        return
    c = seeds.first
    m, w, s = c.market.describe(), c.workload.describe(), c.settings
    runs = [r.settings for r in seeds.runs]
    print(f"market {m['source']}: {m['start']} to {m['end']} ({m['hours']:g} h, "
          f"{m['pools']} pools, {m['rows']} rows, zone labels {m['zone_labels']})",
          file=out)
    sources = {r.workload.source for r in seeds.runs}
    source = w["source"] if len(sources) == 1 else f"gen:{w['requests']} (seeded as below)"
    print(f"workload {source}: {w['requests']} requests", file=out)
    print(f"policy {c.policy}; step {s.step_seconds / 60:g} min, restart "
          f"{s.restart_hours:g} h, max wait {s.max_wait_hours:g} h", file=out)
    print(f"{len(runs)} seeds: market {_span([r.market_seed for r in runs])}, workload "
          f"{_span([r.workload_seed for r in runs])}, draws {_span([r.seed for r in runs])}; "
          f"mean ± half-width of the {CONFIDENCE:.0%} Student-t interval", file=out)
    summary = seeds.summary()["strategies"]
    rows = [("STRATEGY", *(h for h, _, _ in _SUMMARY_COLUMNS))]
    rows += [(d["strategy"], *(_pm(d[k], fmt) for _, k, fmt in _SUMMARY_COLUMNS))
             for d in summary]
    print(file=out)
    _print_rows(rows, out)
    print(file=out)
    print("per seed (market/workload/draws): $/useful GPU-h, interruptions/1k GPU-h, "
          "unplaced", file=out)
    rows = [("SEEDS", *(r.strategy for r in c.results))]
    for run in seeds.per_seed():
        label = "/".join("-" if run[k] is None else str(run[k])
                         for k in ("market_seed", "workload_seed", "draw_seed"))
        rows.append((label, *(" / ".join(
            "-" if f[k] is None else fmt.format(f[k])
            for _, k, fmt in (*_SUMMARY_COLUMNS[:2], ("", "unplaced", "{}")))
            for f in run["strategies"])))
    _print_rows(rows, out)
    if c.private is not None:
        summary_all = seeds.summary()
        cloud = {d["strategy"]: d for d in summary_all["strategies"]}
        _private_table(c, [(d["strategy"], cloud[d["strategy"]], d)
                           for d in summary_all["private"]["strategies"]], _pm_cell, out)


def _pm_cell(value: Any, fmt: str) -> str:
    return _pm(value, fmt)


def _print_rows(rows: Sequence[Sequence[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(wd) if i == 0 else cell.rjust(wd)
                        for i, (cell, wd) in enumerate(zip(row, widths, strict=True))),
              file=out)
