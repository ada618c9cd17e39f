"""Market traces: the recorded history of the resource pool, one row per change.

A trace is what `gpubroker history` exports and what `gpubroker backtest --market` reads.
Rows are ordered by `t`. A row gives its pool's full state from `t` until that pool's
next row; a `gone` row says the pool stopped being offered at `t`. Two encodings:

- JSON Lines (`.jsonl`, `.json`): one object per line,
  `{"t": "2026-11-30T10:00:00Z", "cloud": ..., "region": ..., "zone": ...,
  "instance_type": ..., "market": ..., "gpu": ..., "gpus": ..., "price_per_hour": ...,
  "availability": ..., "capacity": ..., "interruption_rate": ..., "quota_headroom": ...}`
  with `null` for unknown signals; a gone row is the pool key plus `"gone": true`.
- CSV (`.csv`): header `CSV_HEADER`, empty cells for null, `gone` = `1` or empty.

Either may be gzip-compressed (`.jsonl.gz`, `.csv.gz`). `read_trace` validates every row
and names the file and line of the first bad one, so a hand-edited trace fails clearly.

**Bounds.** Every line is bounded before it is parsed (`MAX_LINE_BYTES`, and for JSON
`MAX_JSON_DEPTH` levels of nesting), every value after (times within `EARLIEST` ..
`LATEST`, `gpus` up to `MAX_GPUS`, counts up to `MAX_COUNT`, prices finite and up to
`MAX_PRICE_PER_HOUR`, the spot and on-demand ones positive, rates up to
`MAX_INTERRUPTION_RATE`), so that no file, however made, takes the reader into a
traceback, a recursion or unbounded memory. A pool has at most one row per instant. A
reader that keeps the rows (the backtest) also bounds their number and span
(`read_trace(max_rows=, max_span=)`).
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

from broker.model import Market, Offer, PoolKey
from broker.output.stdio import printable

CSV_HEADER = ("t", "cloud", "region", "zone", "instance_type", "market", "gpu", "gpus",
              "price_per_hour", "availability", "capacity", "interruption_rate",
              "quota_headroom", "gone")

_KEY_FIELDS = ("cloud", "region", "zone", "instance_type")

MAX_LINE_BYTES = 64 * 1024
"""The longest line a trace (or a workload) may have, in bytes; a trace row is about
300. Longer lines are refused before they are decoded."""
MAX_JSON_DEPTH = 16
"""The deepest nesting of arrays and objects a JSON line may have (a trace row is one
flat object; a workload line three levels), checked before `json.loads` recurses."""
EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(2100, 1, 1, tzinfo=UTC)
"""Times in a trace, and the times `parse_when` takes, lie in [EARLIEST, LATEST)."""
MAX_GPUS = 4096
"""The most GPUs an instance of a trace row may have: the most a placement request may
ask for (`broker.wire.validation`)."""
MAX_COUNT = 10**9
"""The largest `capacity` and `quota_headroom` (in absolute value) a trace row may give."""
MAX_PRICE_PER_HOUR = 1_000_000.0
"""The highest price per instance-hour (USD) a trace row may give."""
MAX_INTERRUPTION_RATE = 3600.0
"""The highest interruption rate (per instance-hour) a trace row may give: once a
second."""


class TraceError(ValueError):
    """A trace file that cannot be read: the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One change of one pool. `t` is timezone-aware UTC, whole seconds.

    For a `gone` row every state field is None."""

    t: datetime
    pool: PoolKey
    gpu: str | None = None
    gpus: int | None = None
    price_per_hour: float | None = None
    availability: float | None = None
    capacity: int | None = None
    interruption_rate: float | None = None
    quota_headroom: int | None = None
    gone: bool = False

    @classmethod
    def of(cls, t: datetime, offer: Offer) -> TraceRow:
        """The row recording `offer` as its pool's state from `t` on."""
        return cls(
            t=t, pool=offer.pool, gpu=offer.gpu, gpus=offer.gpus,
            price_per_hour=offer.price_per_hour, availability=offer.availability,
            capacity=offer.capacity, interruption_rate=offer.interruption_rate,
            quota_headroom=offer.quota_headroom,
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON Lines shape (see the module docstring)."""
        d: dict[str, Any] = {"t": format_t(self.t), **self.pool.to_json()}
        if self.gone:
            d["gone"] = True
            return d
        d.update(
            gpu=self.gpu, gpus=self.gpus, price_per_hour=self.price_per_hour,
            availability=self.availability, capacity=self.capacity,
            interruption_rate=self.interruption_rate, quota_headroom=self.quota_headroom,
        )
        return d

    def to_csv(self) -> list[str]:
        """The CSV cells, in `CSV_HEADER` order."""
        p = self.pool
        return [format_t(self.t), p.cloud, p.region, p.zone, p.instance_type,
                p.market.value, _cell(self.gpu), _cell(self.gpus),
                _cell(self.price_per_hour), _cell(self.availability), _cell(self.capacity),
                _cell(self.interruption_rate), _cell(self.quota_headroom),
                "1" if self.gone else ""]


def format_t(t: datetime) -> str:
    """ISO-8601 UTC with a `Z`, seconds resolution (the trace's only time format)."""
    return t.astimezone(UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_when(text: str, now: datetime) -> datetime:
    """A point in time as commands take it: ISO-8601 (`2026-11-30T10:00:00Z`,
    `2026-11-30`; UTC when no zone is given) or a duration back from `now` (`30m`, `6h`,
    `7d`; also `s` and `w`), within `EARLIEST` .. `LATEST`. Raises ValueError with a
    message fit for the user."""
    s = text.strip()
    shown = printable(repr(text), 80)
    if m := _DURATION.fullmatch(s):
        seconds = float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
        most = (now - EARLIEST).total_seconds()
        if not seconds <= most:
            raise ValueError(f"cannot read {shown}: a duration back from now reaches at "
                             f"most {int(most // 86400)} days back (to "
                             f"{format_t(EARLIEST)})")
        return now - timedelta(seconds=seconds)
    try:
        t = datetime.fromisoformat(s.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(f"cannot read {shown}: expected an ISO-8601 time "
                         "(2026-11-30T10:00:00Z) or a duration back from now (30m, 6h, 7d)"
                         ) from None
    t = t if t.tzinfo is not None else t.replace(tzinfo=UTC)
    u = _utc(t)
    if u is None:
        raise ValueError(f"cannot read {shown}: expected a time from {format_t(EARLIEST)} "
                         f"to before {format_t(LATEST)}")
    return u


def _utc(t: datetime) -> datetime | None:
    """`t` (timezone-aware) in UTC, or None when it lies outside EARLIEST .. LATEST
    (also when the shift to UTC would leave the years Python has: 0001-01-01T00:00+01:00
    raises OverflowError there)."""
    try:
        u = t.astimezone(UTC)
    except OverflowError:
        return None
    return u if EARLIEST <= u < LATEST else None


def _cell(v: str | int | float | None) -> str:
    return "" if v is None else str(v)


def write_jsonl(rows: Iterable[TraceRow], out: IO[str]) -> int:
    """Write `rows` as JSON Lines; returns how many were written."""
    n = 0
    for row in rows:
        out.write(json.dumps(row.to_json(), allow_nan=False))
        out.write("\n")
        n += 1
    return n


def write_csv(rows: Iterable[TraceRow], out: IO[str]) -> int:
    """Write the header and `rows` as CSV; returns how many rows were written."""
    w = csv.writer(out, lineterminator="\n")
    w.writerow(CSV_HEADER)
    n = 0
    for row in rows:
        w.writerow(row.to_csv())
        n += 1
    return n


def trace_format(path: str | Path) -> tuple[str, bool]:
    """`("jsonl" | "csv", gzipped)` from a trace file's name; TraceError if neither."""
    name = Path(path).name.lower()
    gz = name.endswith(".gz")
    if gz:
        name = name[:-3]
    if name.endswith((".jsonl", ".json")):
        return "jsonl", gz
    if name.endswith(".csv"):
        return "csv", gz
    raise TraceError(f"{path}: unknown trace format (expected .jsonl, .json or .csv, "
                     "optionally .gz)")


def read_trace(path: str | Path, *, max_rows: int | None = None,
               max_span: timedelta | None = None,
               span_bound: str = "") -> Iterator[TraceRow]:
    """Stream the rows of a trace file, validating each one.

    Raises TraceError (naming the file and line) for a missing file, an unknown
    extension, a line that is too long, too deep or not UTF-8, a malformed row, a row
    whose `t` is earlier than the row before it, a second row of a pool at one instant,
    and, when given, the `max_rows + 1`-th row or a row more than `max_span` after the
    first (`span_bound` then says where that bound comes from).
    """
    fmt, gz = trace_format(path)
    name = printable(path)
    try:
        f: gzip.GzipFile | IO[bytes] = gzip.open(path, "rb") if gz \
            else open(path, "rb")  # noqa: SIM115 (closed by the `with` below)
    except OSError as e:
        raise TraceError(f"{name}: {e.strerror or e}") from e
    with f:
        lines = bounded_lines(f)
        rows = _read_jsonl(lines) if fmt == "jsonl" else _read_csv(lines)
        last: datetime | None = None
        first: datetime | None = None
        here: dict[PoolKey, int] = {}  # the pools with a row at `last`, and its line
        n = 0
        try:
            for lineno, row in rows:
                if last is not None and row.t < last:
                    raise _RowError(lineno, f"t {format_t(row.t)} is earlier than the "
                                            f"row before ({format_t(last)}); rows must be "
                                            "ordered by t")
                if row.t != last:
                    here.clear()
                elif (before := here.get(row.pool)) is not None:
                    raise _RowError(lineno, f"the pool {_pool_name(row.pool)} has a row at "
                                            f"{format_t(row.t)} already (line {before}); "
                                            "a pool has one row per instant")
                here[row.pool] = lineno
                last = row.t
                first = first or row.t
                n += 1
                if max_rows is not None and n > max_rows:
                    raise _RowError(lineno, f"more than {max_rows:,} rows: a trace to "
                                            f"replay has at most {max_rows:,}")
                if max_span is not None and row.t - first > max_span:
                    raise _RowError(lineno, f"t {format_t(row.t)} is more than "
                                            f"{_days(max_span)} after the first row "
                                            f"({format_t(first)}); {span_bound or 'the bound'}")
                yield row
        except _RowError as e:
            raise TraceError(f"{name}: line {e.lineno}: {printable(e.message)}") from None
        except (OSError, EOFError, zlib.error, csv.Error) as e:
            raise TraceError(f"{name}: {printable(e)}") from e


def _days(span: timedelta) -> str:
    days = span.total_seconds() / 86400
    return f"{days:,.0f} days" if days >= 10 else f"{days:g} days"


def _pool_name(pool: PoolKey) -> str:
    return (f"{pool.cloud}/{pool.region}/{pool.zone} {pool.instance_type} "
            f"{pool.market.value}")


def bounded_lines(f: gzip.GzipFile | IO[bytes]) -> Iterator[tuple[int, str]]:
    """The lines of a binary file as text, numbered from 1: each read with at most
    MAX_LINE_BYTES (plus its newline), so a file of one endless line is refused after
    that many bytes, not after reading it all; each decoded on its own, so that bytes
    that are not UTF-8 are named by their line. Raises LineError."""
    lineno = 0
    while True:
        line = f.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        lineno += 1
        if len(line) > MAX_LINE_BYTES and line[-1:] != b"\n":
            raise _RowError(lineno, f"the line is longer than {MAX_LINE_BYTES:,} bytes "
                                    "(MAX_LINE_BYTES)")
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _RowError(lineno, f"not UTF-8: byte {line[e.start]:#04x} at column "
                                    f"{len(line[:e.start].decode('utf-8')) + 1}") from None
        if lineno == 1 and text.startswith("\ufeff"):
            text = text[1:]  # a byte order mark
        yield lineno, text


def json_line(text: str) -> Any:
    """One JSON line, parsed: its nesting checked against MAX_JSON_DEPTH before
    `json.loads` (whose recursion a line of 100,000 `[` would exhaust), and every way
    it can fail (malformed JSON, an integer of more digits than Python converts) a
    ValueError with a message fit for the user."""
    if len(text) > MAX_LINE_BYTES:
        raise ValueError(f"the line is longer than {MAX_LINE_BYTES:,} bytes (MAX_LINE_BYTES)")
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and \
            _depth(text) > MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels (MAX_JSON_DEPTH)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e.msg} (column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # `int` of more than 4,300 digits
        raise ValueError(f"not JSON this reader takes: {printable(e, 120)}") from None


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[\[\]{}]")


def _depth(text: str) -> int:
    """The deepest nesting of `text`'s arrays and objects (brackets inside strings do
    not count), in one linear pass."""
    depth = deepest = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        if m.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


class LineError(Exception):
    """A bad line of a file read by `bounded_lines`: its number and what is wrong."""

    def __init__(self, lineno: int, message: str) -> None:
        super().__init__(lineno, message)
        self.lineno = lineno
        self.message = message


_RowError = LineError


def _read_jsonl(lines: Iterator[tuple[int, str]]) -> Iterator[tuple[int, TraceRow]]:
    for lineno, line in lines:
        if not line.strip():
            continue
        try:
            d = json_line(line)
        except ValueError as e:
            raise _RowError(lineno, str(e)) from None
        if not isinstance(d, dict):
            raise _RowError(lineno, "expected a JSON object")
        yield lineno, _row(lineno, d)


def _read_csv(lines: Iterator[tuple[int, str]]) -> Iterator[tuple[int, TraceRow]]:
    numbers = [0]

    def text() -> Iterator[str]:
        for lineno, line in lines:
            numbers[0] = lineno
            yield line

    reader = csv.reader(text())
    header = next(reader, None)
    if header is None:
        return
    header = [h.strip() for h in header]
    missing = [h for h in ("t", "market", *_KEY_FIELDS) if h not in header]
    if missing:
        raise _RowError(1, f"CSV header lacks {', '.join(missing)} "
                           f"(expected {','.join(CSV_HEADER)})")
    for row in reader:
        lineno = numbers[0]
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != len(header):
            raise _RowError(lineno, f"{len(row)} cells, the header has {len(header)}")
        d: dict[str, Any] = {}
        for name, cell in zip(header, row, strict=True):
            cell = cell.strip()
            if cell == "":
                d[name] = None
            elif name in ("gpus", "capacity", "quota_headroom", "price_per_hour",
                          "availability", "interruption_rate"):
                d[name] = _csv_number(lineno, name, cell)
            elif name == "gone":
                d[name] = _csv_bool(lineno, cell)
            else:
                d[name] = cell
        yield lineno, _row(lineno, d)


def _csv_number(lineno: int, name: str, cell: str) -> int | float:
    try:
        return int(cell)
    except ValueError:
        pass
    try:
        return float(cell)
    except ValueError:
        raise _RowError(lineno, f"{name}: not a number: {_shown(cell)}") from None


def _csv_bool(lineno: int, cell: str) -> bool:
    low = cell.lower()
    if low in ("1", "true", "yes"):
        return True
    if low in ("0", "false", "no"):
        return False
    raise _RowError(lineno, f"gone: expected 1 or empty, got {_shown(cell)}")


def _row(lineno: int, d: dict[str, Any]) -> TraceRow:
    """Validate one decoded row (JSON object or CSV cells, None for empty)."""
    t = _t(lineno, d.get("t"))
    key: list[str] = []
    for name in _KEY_FIELDS:
        v = d.get(name)
        if not isinstance(v, str) or not v:
            raise _RowError(lineno, f"{name}: expected a non-empty string, got {_shown(v)}")
        key.append(v)
    m = d.get("market")
    try:
        market = Market(str(m))
    except ValueError:
        raise _RowError(lineno,
                        f"market: expected spot, on_demand or reserved, got {_shown(m)}") from None
    pool = PoolKey(key[0], key[1], key[2], key[3], market)
    gone = d.get("gone")
    if gone is None:
        gone = False
    if not isinstance(gone, bool):
        raise _RowError(lineno, f"gone: expected true or false, got {_shown(gone)}")
    if gone:
        return TraceRow(t=t, pool=pool, gone=True)
    gpu = d.get("gpu")
    if not isinstance(gpu, str) or not gpu:
        raise _RowError(lineno, f"gpu: expected a GPU model name, got {_shown(gpu)}")
    gpus = _int(lineno, d, "gpus", 1, MAX_GPUS)
    if gpus is None:
        raise _RowError(lineno, f"gpus: expected a whole number from 1 to {MAX_GPUS}, "
                                "got None")
    availability = _float(lineno, d, "availability", math.inf)
    if availability is not None and availability > 1:
        raise _RowError(lineno, f"availability: expected 0..1, got {availability!r}")
    price = _float(lineno, d, "price_per_hour", MAX_PRICE_PER_HOUR)
    if price == 0 and market is not Market.RESERVED:
        # Paid-for capacity may cost nothing more per hour (a private group's internal
        # price of 0); what the clouds sell never does.
        raise _RowError(lineno, f"price_per_hour: a {market.value} price must be > 0, "
                                "got 0")
    return TraceRow(
        t=t, pool=pool, gpu=gpu, gpus=gpus,
        price_per_hour=price,
        availability=availability,
        capacity=_int(lineno, d, "capacity", 0, MAX_COUNT),
        interruption_rate=_float(lineno, d, "interruption_rate", MAX_INTERRUPTION_RATE),
        quota_headroom=_int(lineno, d, "quota_headroom", -MAX_COUNT, MAX_COUNT),
    )


def _t(lineno: int, v: Any) -> datetime:
    if not isinstance(v, str):
        raise _RowError(lineno, f"t: expected an ISO-8601 time, got {_shown(v)}")
    try:
        t = datetime.fromisoformat(v.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise _RowError(lineno, f"t: not an ISO-8601 time: {_shown(v)}") from None
    if t.tzinfo is None:
        raise _RowError(lineno, f"t: {_shown(v)} has no time zone (write UTC as ...Z)")
    u = _utc(t)
    if u is None:
        raise _RowError(lineno, f"t: {_shown(v)} is outside {format_t(EARLIEST)} .. "
                                f"{format_t(LATEST)} (EARLIEST .. LATEST)")
    return u.replace(microsecond=0)


def _float(lineno: int, d: dict[str, Any], name: str, most: float) -> float | None:
    v = d.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise _RowError(lineno, f"{name}: expected a number or null, got {_shown(v)}")
    if v < 0:
        raise _RowError(lineno, f"{name}: must not be negative, got {_shown(v)}")
    if v > most:  # (availability: checked by the caller)
        raise _RowError(lineno, f"{name}: must be ≤ {most:g}, got {_shown(v)}")
    return float(v)


def _int(lineno: int, d: dict[str, Any], name: str, least: int, most: int) -> int | None:
    v = d.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _RowError(lineno, f"{name}: expected a whole number or null, got {_shown(v)}")
    if v < least:
        raise _RowError(lineno, f"{name}: must be ≥ {least:,}, got {_big(v)}")
    if v > most:
        raise _RowError(lineno, f"{name}: must be ≤ {most:,}, got {_big(v)}")
    return v


def _big(v: int) -> str:
    return str(v) if abs(v) < 10**30 else f"{float(v):g}"


def _shown(v: Any) -> str:
    """A value of the file, as an error quotes it: `repr`, control characters escaped,
    at most 80 characters."""
    return printable(repr(v), 80)
