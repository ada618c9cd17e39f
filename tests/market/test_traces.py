"""Tests of market traces (`broker/market/traces.py`): both encodings, gzip, validation."""

from __future__ import annotations

import gzip
import io
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from factories import T0, key, offer

from broker.market.traces import (
    CSV_HEADER,
    TraceError,
    TraceRow,
    format_t,
    parse_when,
    read_trace,
    write_csv,
    write_jsonl,
)
from broker.model import Market

A = key("us-east-1a")
B = key("us-east-1b", market=Market.ON_DEMAND)
ROWS = [
    TraceRow(t=T0, pool=A, gpu="H100-80GB", gpus=8, price_per_hour=12.3, availability=0.8,
             capacity=3, interruption_rate=0.05, quota_headroom=64),
    TraceRow(t=T0, pool=B, gpu="H100-80GB", gpus=8, price_per_hour=98.32),
    TraceRow(t=T0 + timedelta(minutes=5), pool=A, gone=True),
]


def test_jsonl_has_the_contract_shape() -> None:
    out = io.StringIO()
    assert write_jsonl(ROWS, out) == 3
    first, second, gone = (json.loads(line) for line in out.getvalue().splitlines())
    assert first == {"t": "2026-11-30T12:00:00Z", "cloud": "aws", "region": "us-east-1",
                     "zone": "us-east-1a", "instance_type": "p5.48xlarge", "market": "spot",
                     "gpu": "H100-80GB", "gpus": 8, "price_per_hour": 12.3,
                     "availability": 0.8, "capacity": 3, "interruption_rate": 0.05,
                     "quota_headroom": 64}
    assert second["availability"] is None and second["market"] == "on_demand"
    assert gone == {"t": "2026-11-30T12:05:00Z", **A.to_json(), "gone": True}


def test_csv_has_the_contract_header_and_empty_cells_for_null() -> None:
    out = io.StringIO()
    assert write_csv(ROWS, out) == 3
    header, first, second, gone = out.getvalue().splitlines()
    assert header == ",".join(CSV_HEADER) == (
        "t,cloud,region,zone,instance_type,market,gpu,gpus,price_per_hour,availability,"
        "capacity,interruption_rate,quota_headroom,gone")
    assert first == ("2026-11-30T12:00:00Z,aws,us-east-1,us-east-1a,p5.48xlarge,spot,"
                     "H100-80GB,8,12.3,0.8,3,0.05,64,")
    assert second.endswith(",H100-80GB,8,98.32,,,,,")
    assert gone == "2026-11-30T12:05:00Z,aws,us-east-1,us-east-1a,p5.48xlarge,spot,,,,,,,,1"


@pytest.mark.parametrize("name", ["m.jsonl", "m.json", "m.csv", "m.jsonl.gz", "m.csv.gz"])
def test_every_format_round_trips(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    write = write_csv if ".csv" in name else write_jsonl
    with (gzip.open(path, "wt", encoding="utf-8", newline="") if name.endswith(".gz")
          else path.open("w", encoding="utf-8", newline="")) as f:
        write(ROWS, f)
    back = list(read_trace(path))
    assert back == ROWS
    assert all(r.t.tzinfo is UTC for r in back)
    assert isinstance(back[0].capacity, int) and isinstance(back[0].price_per_hour, float)


def test_of_takes_an_offers_state() -> None:
    o = offer(price=24.0, availability=0.5, capacity=2, quota_headroom=16)
    row = TraceRow.of(T0, o)
    assert (row.pool, row.gpu, row.gpus, row.price_per_hour, row.availability, row.capacity,
            row.interruption_rate, row.quota_headroom, row.gone) == (
        o.pool, "H100-80GB", 8, 24.0, 0.5, 2, 0.0, 16, False)


def test_times_are_utc_seconds_with_z() -> None:
    t = datetime(2026, 11, 30, 13, 0, 0, 999_000, tzinfo=UTC).astimezone(
        datetime.now().astimezone().tzinfo)
    assert format_t(t) == "2026-11-30T13:00:00Z"


def lines_of(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


GOOD = json.dumps(ROWS[0].to_json())


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    (GOOD.replace('"2026-11-30T12:00:00Z"', '"yesterday"'), "t: not an ISO-8601 time"),
    (GOOD.replace('"2026-11-30T12:00:00Z"', '"2026-11-30T12:00:00"'), "has no time zone"),
    (GOOD.replace('"spot"', '"preemptible"'), "market: expected spot, on_demand or reserved"),
    (GOOD.replace('"zone": "us-east-1a", ', ""), "zone: expected a non-empty string"),
    (GOOD.replace('"gpus": 8', '"gpus": 0'), "gpus: must be ≥ 1"),
    (GOOD.replace('"gpus": 8', '"gpus": "8"'), "gpus: expected a whole number"),
    (GOOD.replace('"price_per_hour": 12.3', '"price_per_hour": "cheap"'),
     "price_per_hour: expected a number"),
    (GOOD.replace('"price_per_hour": 12.3', '"price_per_hour": -1'), "must not be negative"),
    (GOOD.replace('"availability": 0.8', '"availability": 1.5'), "availability: expected 0..1"),
    (GOOD.replace('"capacity": 3', '"capacity": true'), "capacity: expected a whole number"),
    (GOOD.replace('"gpu": "H100-80GB", ', ""), "gpu: expected a GPU model name"),
    (GOOD.replace("}", ', "gone": "yes"}'), "gone: expected true or false"),
])
def test_a_bad_jsonl_line_is_named_by_its_number(tmp_path: Path, line: str,
                                                 message: str) -> None:
    path = lines_of(tmp_path, "m.jsonl", f"{GOOD}\n\n{line}\n{GOOD}\n")
    with pytest.raises(TraceError) as err:
        list(read_trace(path))
    assert str(err.value).startswith(f"{path}: line 3: ")
    assert message in str(err.value)


def test_a_bad_csv_line_is_named_by_its_number(tmp_path: Path) -> None:
    out = io.StringIO()
    write_csv(ROWS[:2], out)
    text = out.getvalue() + "2026-11-30T12:10:00Z,aws,us-east-1,us-east-1a,p5,spot,T4,1,x,,,,,\n"
    with pytest.raises(TraceError, match=r"line 4: price_per_hour: not a number: 'x'"):
        list(read_trace(lines_of(tmp_path, "m.csv", text)))
    short = out.getvalue() + "2026-11-30T12:10:00Z,aws\n"
    with pytest.raises(TraceError, match=r"line 4: 2 cells, the header has 14"):
        list(read_trace(lines_of(tmp_path, "s.csv", short)))
    with pytest.raises(TraceError, match=r"line 1: CSV header lacks t, market"):
        list(read_trace(lines_of(tmp_path, "h.csv", "when,cloud,region,zone,instance_type\n")))


def test_rows_out_of_time_order_are_refused(tmp_path: Path) -> None:
    later, earlier = ROWS[2], ROWS[0]
    out = io.StringIO()
    write_jsonl([later, earlier], out)
    with pytest.raises(TraceError, match=r"line 2: t 2026-11-30T12:00:00Z is earlier than"):
        list(read_trace(lines_of(tmp_path, "m.jsonl", out.getvalue())))


def test_rows_stream_before_a_later_bad_line(tmp_path: Path) -> None:
    path = lines_of(tmp_path, "m.jsonl", f"{GOOD}\n{{oops\n")
    rows = read_trace(path)
    assert next(rows) == ROWS[0]
    with pytest.raises(TraceError, match="line 2"):
        next(rows)


def test_unknown_extension_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"unknown trace format"):
        list(read_trace(tmp_path / "m.parquet"))
    with pytest.raises(TraceError, match=r"nope.jsonl: No such file"):
        list(read_trace(tmp_path / "nope.jsonl"))


def test_parse_when_takes_iso_and_durations() -> None:
    now = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    assert parse_when("2026-11-30T10:00:00Z", now) == datetime(2026, 11, 30, 10, tzinfo=UTC)
    assert parse_when("2026-11-30T11:00:00+01:00", now) == datetime(2026, 11, 30, 10,
                                                                     tzinfo=UTC)
    assert parse_when("2026-11-30", now) == datetime(2026, 11, 30, tzinfo=UTC)
    assert parse_when("30m", now) == now - timedelta(minutes=30)
    assert parse_when("6h", now) == now - timedelta(hours=6)
    assert parse_when("1.5d", now) == now - timedelta(hours=36)
    for bad in ("yesterday", "6 hours", "-6h", ""):
        with pytest.raises(ValueError, match="expected an ISO-8601 time"):
            parse_when(bad, now)
