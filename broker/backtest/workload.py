"""The requests a backtest replays: read from a JSON Lines file, or generated.

One request per line:

    {"at": "2026-11-30T10:05:00Z", "scheduler": "s1", "request": {...}}
    {"at_hours": 1.5, "scheduler": "s1", "request": {...}}
    {"at_hours": 2, "request": {...}, "startup_minutes": 25, "checkpoint_minutes": 60}

`at` is an absolute time (with a time zone), `at_hours` hours after the market's start;
exactly one of them. `startup_minutes` (boot, image pull and checkpoint load: paid, no
useful work, after every placement and every move) and `checkpoint_minutes` (how often
the job saves its work; an interruption or a move loses the work since the last one; 0:
it loses nothing) are optional, numbers >= 0; a line without them takes the backtest's
`--startup-minutes` and `--checkpoint-minutes`. `scheduler` is the scheduler id S
(default `backtest`). `request` is a placement request as on `P/requests/S/place` (SPEC
§4), validated by the daemon's own `broker.wire.validation.parse_place`, so the errors are the
daemon's; a backtest also needs its `duration_hours` (the hours of useful work the job
needs). Every problem is reported as `FILE:LINE: field: message`.

`gen:N[:SEED]` generates N requests, seeded: GPU models weighted by how many pools of the
market offer them, 1/2/4/8/16 GPUs, durations lognormal around 3 hours, four teams, a
quarter with a price cap, a fifth spot-only and a sixth on-demand-only, spread over the
first 90 % of the market's span. Generated requests name no start-up or checkpoint
interval: `--startup-minutes` and `--checkpoint-minutes` apply to all of them.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from broker.backtest.market import MAX_SPAN_DAYS, MarketTrace
from broker.market.traces import EARLIEST, LATEST, LineError, bounded_lines, format_t, json_line
from broker.model import GPU_MODELS, SCHEDULER_ID, PlaceRequest, parse_iso
from broker.output.stdio import printable
from broker.wire import validation

DEFAULT_SCHEDULER = "backtest"
MAX_PROBLEMS = 20
MAX_REQUESTS = 1_000_000
"""The most requests a workload file may hold (as many as `gen:N` makes at most)."""
MAX_AT_HOURS = MAX_SPAN_DAYS * 24.0
"""The latest `at_hours` a workload line may give: the longest market's span."""
MAX_MINUTES = MAX_SPAN_DAYS * 1440.0
"""The longest `startup_minutes` and `checkpoint_minutes` a workload line may give."""


class WorkloadError(ValueError):
    """A workload that cannot be used; `problems` has one `FILE:LINE: ...` per problem."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request, arriving `at` seconds after the market's start."""

    at: float
    request: PlaceRequest
    line: int = 0  # in the workload file; 0 when generated
    startup_minutes: float | None = None  # None: the backtest's --startup-minutes
    checkpoint_minutes: float | None = None  # None: the backtest's --checkpoint-minutes

    @property
    def duration_hours(self) -> float:
        assert self.request.duration_hours is not None
        return self.request.duration_hours


@dataclass(frozen=True, slots=True)
class Workload:
    source: str
    arrivals: tuple[Arrival, ...]  # in time order (file order within an instant)
    outside: int = 0  # requests at or after the market's end, left out
    seed: int | None = None  # a generated workload's seed (None: read from a file)

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "requests": len(self.arrivals),
                "gpu_hours_asked": round(sum(a.request.gpus * a.duration_hours
                                             for a in self.arrivals), 6),
                "left_out_after_market_end": self.outside}


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def parse_line(text: str, *, market: MarketTrace) -> tuple[float, PlaceRequest]:
    """One workload line: (seconds after the market's start, the request). Raises
    ValueError with the message to show after `FILE:LINE: `."""
    at, req, _, _ = parse_arrival(text, market=market)
    return at, req


# Complex: one check per field of a workload line, each with its own message.
def parse_arrival(text: str, *, market: MarketTrace  # noqa: C901, PLR0912
                  ) -> tuple[float, PlaceRequest, float | None, float | None]:
    """One workload line: (seconds after the market's start, the request, its
    startup_minutes, its checkpoint_minutes). Raises ValueError as `parse_line` does."""
    try:
        d = json_line(text)  # bounded in length and depth before it is parsed
    except ValueError as exc:
        raise ValueError(str(exc).replace("not JSON:", "not valid JSON:", 1)) from None
    if not isinstance(d, dict):
        raise ValueError("expected a JSON object with at or at_hours, scheduler, request")
    if ("at" in d) == ("at_hours" in d):
        raise ValueError("needs exactly one of at (a time) or at_hours (hours after the "
                         "market's start)")
    if "at" in d:
        at_text = d["at"]
        try:
            if not isinstance(at_text, str):
                raise ValueError
            t = parse_iso(at_text)
        except ValueError:
            raise ValueError(f"at: not a time: {at_text!r} (write e.g. "
                             "2026-11-30T10:05:00Z)") from None
        if t.tzinfo is None:
            raise ValueError(f"at: {at_text!r} has no time zone (write UTC as ...Z)")
        if not EARLIEST <= t < LATEST:  # (aware datetimes compare in UTC, never overflow)
            raise ValueError(f"at: {at_text!r} is outside {format_t(EARLIEST)} .. "
                             f"{format_t(LATEST)} (EARLIEST .. LATEST)")
        at = (t - market.start).total_seconds()
        if at < 0:
            raise ValueError(f"at: {at_text!r} is before the market starts "
                             f"({market.describe()['start']})")
    else:
        hours = d["at_hours"]
        if not _number(hours) or hours < 0:
            raise ValueError(f"at_hours: expected a number >= 0, got {hours!r}")
        if hours > MAX_AT_HOURS:
            raise ValueError(f"at_hours: must be at most {MAX_AT_HOURS:g} "
                             f"(MAX_AT_HOURS), got {hours!r}")
        at = round(float(hours) * 3600.0, 3)
    scheduler = d.get("scheduler", DEFAULT_SCHEDULER)
    if not isinstance(scheduler, str) or not SCHEDULER_ID.match(scheduler):
        raise ValueError(f"scheduler: must match [A-Za-z0-9_.-]{{1,64}}, got {scheduler!r}")
    body = d.get("request")
    if not isinstance(body, dict):
        raise ValueError("request: required, a placement request object (SPEC §4)")
    req = validation.parse_place(scheduler, json.dumps(body).encode())
    if isinstance(req, validation.Invalid):
        raise ValueError("; ".join(f"request.{e['field']}: {e['message']}" if e["field"]
                                   else f"request: {e['message']}" for e in req.errors))
    if req.max_parts > 1:
        raise ValueError("request.max_parts: the backtest places every request whole; "
                         "splits across pools are not simulated (leave it out)")
    if req.duration_hours is None:
        raise ValueError("request.duration_hours: required in a backtest (the hours of "
                         "useful work the job needs)")
    minutes: list[float | None] = []
    for name in ("startup_minutes", "checkpoint_minutes"):
        value = d.get(name)
        if value is not None and (not _number(value) or value < 0):
            raise ValueError(f"{name}: expected a number >= 0, got {value!r}")
        if value is not None and value > MAX_MINUTES:
            raise ValueError(f"{name}: must be at most {MAX_MINUTES:g} (MAX_MINUTES), "
                             f"got {value!r}")
        minutes.append(None if value is None else float(value))
    return at, req, minutes[0], minutes[1]


def load_workload(path: Path, *, market: MarketTrace) -> Workload:
    """Read and validate a workload file; raises WorkloadError with every problem
    (up to MAX_PROBLEMS), each naming the file and line."""
    name = printable(path)
    problems: list[str] = []
    arrivals: list[Arrival] = []
    seen: dict[tuple[str, str], int] = {}
    outside = 0

    def problem(text: str) -> bool:
        """Note one; True when there are enough to stop."""
        problems.append(printable(text))
        if len(problems) >= MAX_PROBLEMS:
            problems.append(f"{name}: stopping after {MAX_PROBLEMS} problems")
            return True
        return False

    try:
        with open(path, "rb") as f:
            for lineno, line in bounded_lines(f):
                if not line.strip():
                    continue
                if len(seen) >= MAX_REQUESTS:
                    problem(f"{name}:{lineno}: more than {MAX_REQUESTS:,} requests "
                            "(MAX_REQUESTS)")
                    break
                try:
                    at, req, startup, checkpoint = parse_arrival(line, market=market)
                except ValueError as exc:
                    if problem(f"{name}:{lineno}: {exc}"):
                        break
                    continue
                ident = (req.scheduler, req.request_id)
                if ident in seen:
                    if problem(f"{name}:{lineno}: request.request_id: {req.request_id!r} of "
                               f"scheduler {req.scheduler!r} is already on line "
                               f"{seen[ident]} (request_id is the idempotency key)"):
                        break
                    continue
                seen[ident] = lineno
                if at >= market.seconds:
                    outside += 1
                    continue
                arrivals.append(Arrival(at, req, lineno, startup, checkpoint))
    except LineError as exc:
        problem(f"{name}:{exc.lineno}: {exc.message}")
    except OSError as exc:
        raise WorkloadError([f"{name}: {printable(exc.strerror or exc)}"]) from None
    if problems:
        raise WorkloadError(problems)
    if not arrivals:
        raise WorkloadError([f"{name}: no request arrives within the market's span "
                             f"({market.describe()['start']} to {market.describe()['end']})"])
    arrivals.sort(key=lambda a: a.at)  # stable: file order within an instant
    return Workload(str(path), tuple(arrivals), outside)


def save_workload(workload: Workload, path: Path, *, market: MarketTrace) -> None:
    """Write `workload` as a workload file (absolute `at` times)."""
    with open(path, "w", encoding="utf-8") as f:
        for a in workload.arrivals:
            line: dict[str, Any] = {"at": _at_text(market.at(a.at)),
                                    "scheduler": a.request.scheduler,
                                    "request": a.request.to_json()}
            if a.startup_minutes is not None:
                line["startup_minutes"] = a.startup_minutes
            if a.checkpoint_minutes is not None:
                line["checkpoint_minutes"] = a.checkpoint_minutes
            f.write(json.dumps(line, separators=(",", ":")) + "\n")


def _at_text(t: datetime) -> str:
    text = t.strftime("%Y-%m-%dT%H:%M:%S")
    if t.microsecond:
        text += f".{t.microsecond // 1000:03d}"
    return text + "Z"


# --- generated workloads -----------------------------------------------------------------

_GEN_SPEC = re.compile(r"^gen:(\d+)(?::(-?\d+))?$")
_COUNTS = ((1, 0.34), (2, 0.2), (4, 0.2), (8, 0.2), (16, 0.06))
_TEAMS = ("research", "training", "inference", "eval")
_SCHEDULERS = ("s1", "s2", "s3", "s4")
# Models a job could also run on, if the request says so (same memory or more).
_ALSO = {"A100-40GB": "A100-80GB", "A10": "A10G", "A10G": "A10", "L4": "A10G",
         "T4": "L4", "V100-16GB": "V100-32GB", "A100-80GB": "H100-80GB"}


def parse_gen_spec(text: str, *, default_seed: int) -> tuple[int, int] | None:
    """`gen:N[:SEED]` → (N, seed); None when `text` does not start with `gen:`."""
    if not text.startswith("gen:"):
        return None
    m = _GEN_SPEC.match(text)
    if m is None or not 1 <= int(m.group(1)) <= 1_000_000:
        raise WorkloadError([f"--workload {text!r}: expected gen:N[:SEED] with N from 1 to "
                             "1000000, e.g. gen:3000 or gen:3000:42"])
    return int(m.group(1)), int(m.group(2)) if m.group(2) is not None else default_seed


def _weighted(rng: random.Random, items: Sequence[tuple[Any, float]]) -> Any:
    x = rng.random() * sum(w for _, w in items)
    for item, w in items:
        x -= w
        if x < 0:
            return item
    return items[-1][0]


def generate_workload(n: int, *, seed: int, market: MarketTrace) -> Workload:
    """N seeded requests fitted to `market` (see the module docstring)."""
    rng = random.Random(f"backtest-workload:{seed}")
    models = [(g, float(c)) for g, c in market.gpu_pools.items() if g in GPU_MODELS]
    if not models:
        raise WorkloadError([f"gen:{n}: the market offers no priced GPU model to ask for"])
    offered = {g for g, _ in models}
    span = market.seconds * 0.9
    minutes = sorted(rng.randrange(0, max(1, int(span // 60))) for _ in range(n))
    arrivals = []
    for i, minute in enumerate(minutes):
        gpu = _weighted(rng, models)
        body: dict[str, Any] = {
            "request_id": f"job-{i + 1:05d}",
            "gpu": gpu,
            "gpus": _weighted(rng, _COUNTS),
            "team": rng.choice(_TEAMS),
            "duration_hours": round(min(48.0, max(0.25, rng.lognormvariate(math.log(3.0),
                                                                           0.8))), 2),
        }
        also = _ALSO.get(gpu)
        if also in offered and rng.random() < 0.2:
            body["gpu"] = [gpu, also]
        market_pick = rng.random()
        if market_pick < 0.2:
            body["market"] = "spot"
        elif market_pick < 0.2 + 1 / 6:
            body["market"] = "on_demand"
        if rng.random() < 0.25 and gpu in market.on_demand_ppg:
            # At least $0.0001: a cap must be > 0, and the on-demand price per GPU of a
            # trace can be smaller than that (a price of $0.001 an hour over 16 GPUs).
            body["max_price_per_gpu_hour"] = max(0.0001, round(
                market.on_demand_ppg[gpu] * rng.uniform(0.6, 1.3), 4))
        scheduler = rng.choice(_SCHEDULERS)
        req = validation.parse_place(scheduler, json.dumps(body).encode())
        assert isinstance(req, PlaceRequest), req
        arrivals.append(Arrival(float(minute * 60), req))
    return Workload(f"gen:{n}:{seed}", tuple(arrivals), seed=seed)


def load_or_generate(text: str, *, seed: int, market: MarketTrace) -> Workload:
    """`--workload`: `gen:...` or a file."""
    spec = parse_gen_spec(text, default_seed=seed)
    if spec is not None:
        return generate_workload(spec[0], seed=spec[1], market=market)
    return load_workload(Path(text), market=market)

