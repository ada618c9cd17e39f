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
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

from broker.model import Market, Offer, PoolKey

CSV_HEADER = ("t", "cloud", "region", "zone", "instance_type", "market", "gpu", "gpus",
              "price_per_hour", "availability", "capacity", "interruption_rate",
              "quota_headroom", "gone")

_KEY_FIELDS = ("cloud", "region", "zone", "instance_type")


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
    `7d`; also `s` and `w`). Raises ValueError with a message fit for the user."""
    s = text.strip()
    if m := _DURATION.fullmatch(s):
        return now - timedelta(seconds=float(m.group(1)) * _UNIT_SECONDS[m.group(2)])
    try:
        t = datetime.fromisoformat(s.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(f"cannot read {text!r}: expected an ISO-8601 time "
                         "(2026-11-30T10:00:00Z) or a duration back from now (30m, 6h, 7d)"
                         ) from None
    return (t if t.tzinfo is not None else t.replace(tzinfo=UTC)).astimezone(UTC)


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


def read_trace(path: str | Path) -> Iterator[TraceRow]:
    """Stream the rows of a trace file, validating each one.

    Raises TraceError (naming the file and line) for a missing file, an unknown
    extension, a malformed row, or a row whose `t` is earlier than the row before it.
    """
    fmt, gz = trace_format(path)
    try:
        f = _open_text(path, gz)
    except OSError as e:
        raise TraceError(f"{path}: {e.strerror or e}") from e
    with f:
        rows = _read_jsonl(f) if fmt == "jsonl" else _read_csv(f)
        last: datetime | None = None
        try:
            for lineno, row in rows:
                if last is not None and row.t < last:
                    raise _RowError(lineno, f"t {format_t(row.t)} is earlier than the "
                                            f"row before ({format_t(last)}); rows must be "
                                            "ordered by t")
                last = row.t
                yield row
        except _RowError as e:
            raise TraceError(f"{path}: line {e.lineno}: {e.message}") from None
        except (OSError, EOFError, UnicodeDecodeError, csv.Error) as e:
            raise TraceError(f"{path}: {e}") from e


def _open_text(path: str | Path, gz: bool) -> IO[str]:
    if gz:
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


class _RowError(Exception):
    def __init__(self, lineno: int, message: str) -> None:
        super().__init__(lineno, message)
        self.lineno = lineno
        self.message = message


def _read_jsonl(f: IO[str]) -> Iterator[tuple[int, TraceRow]]:
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise _RowError(lineno, f"not JSON: {e.msg}") from None
        if not isinstance(d, dict):
            raise _RowError(lineno, "expected a JSON object")
        yield lineno, _row(lineno, d)


def _read_csv(f: IO[str]) -> Iterator[tuple[int, TraceRow]]:
    reader = csv.reader(f)
    header = next(reader, None)
    if header is None:
        return
    header = [h.strip() for h in header]
    missing = [h for h in ("t", "market", *_KEY_FIELDS) if h not in header]
    if missing:
        raise _RowError(1, f"CSV header lacks {', '.join(missing)} "
                           f"(expected {','.join(CSV_HEADER)})")
    for row in reader:
        lineno = reader.line_num
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
        raise _RowError(lineno, f"{name}: not a number: {cell!r}") from None


def _csv_bool(lineno: int, cell: str) -> bool:
    low = cell.lower()
    if low in ("1", "true", "yes"):
        return True
    if low in ("0", "false", "no"):
        return False
    raise _RowError(lineno, f"gone: expected 1 or empty, got {cell!r}")


def _row(lineno: int, d: dict[str, Any]) -> TraceRow:
    """Validate one decoded row (JSON object or CSV cells, None for empty)."""
    t = _t(lineno, d.get("t"))
    key: list[str] = []
    for name in _KEY_FIELDS:
        v = d.get(name)
        if not isinstance(v, str) or not v:
            raise _RowError(lineno, f"{name}: expected a non-empty string, got {v!r}")
        key.append(v)
    m = d.get("market")
    try:
        market = Market(str(m))
    except ValueError:
        raise _RowError(lineno,
                        f"market: expected spot, on_demand or reserved, got {m!r}") from None
    pool = PoolKey(key[0], key[1], key[2], key[3], market)
    gone = d.get("gone")
    if gone is None:
        gone = False
    if not isinstance(gone, bool):
        raise _RowError(lineno, f"gone: expected true or false, got {gone!r}")
    if gone:
        return TraceRow(t=t, pool=pool, gone=True)
    gpu = d.get("gpu")
    if not isinstance(gpu, str) or not gpu:
        raise _RowError(lineno, f"gpu: expected a GPU model name, got {gpu!r}")
    gpus = _int(lineno, d, "gpus", minimum=1)
    if gpus is None:
        raise _RowError(lineno, "gpus: expected a whole number ≥ 1, got None")
    availability = _float(lineno, d, "availability")
    if availability is not None and availability > 1:
        raise _RowError(lineno, f"availability: expected 0..1, got {availability!r}")
    return TraceRow(
        t=t, pool=pool, gpu=gpu, gpus=gpus,
        price_per_hour=_float(lineno, d, "price_per_hour"),
        availability=availability,
        capacity=_int(lineno, d, "capacity", minimum=0),
        interruption_rate=_float(lineno, d, "interruption_rate"),
        quota_headroom=_int(lineno, d, "quota_headroom", minimum=None),
    )


def _t(lineno: int, v: Any) -> datetime:
    if not isinstance(v, str):
        raise _RowError(lineno, f"t: expected an ISO-8601 time, got {v!r}")
    try:
        t = datetime.fromisoformat(v.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise _RowError(lineno, f"t: not an ISO-8601 time: {v!r}") from None
    if t.tzinfo is None:
        raise _RowError(lineno, f"t: {v!r} has no time zone (write UTC as ...Z)")
    return t.astimezone(UTC).replace(microsecond=0)


def _float(lineno: int, d: dict[str, Any], name: str) -> float | None:
    v = d.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise _RowError(lineno, f"{name}: expected a number or null, got {v!r}")
    if v < 0:
        raise _RowError(lineno, f"{name}: must not be negative, got {v!r}")
    return float(v)


def _int(lineno: int, d: dict[str, Any], name: str, minimum: int | None) -> int | None:
    v = d.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _RowError(lineno, f"{name}: expected a whole number or null, got {v!r}")
    if minimum is not None and v < minimum:
        raise _RowError(lineno, f"{name}: must be ≥ {minimum}, got {v!r}")
    return v
