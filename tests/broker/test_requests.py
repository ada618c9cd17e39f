"""Tests of the validation of what schedulers send (`broker/requests.py`)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from broker.model import PlaceRequest
from broker.requests import (
    Invalid,
    LeaseRef,
    Report,
    parse_lease_ref,
    parse_place,
    parse_report,
)

MINIMAL = {"request_id": "job-1", "gpu": "A100-80GB", "gpus": 8}


def body(**changes: Any) -> bytes:
    """MINIMAL with `changes`; a value of `...` drops the field."""
    d = {**MINIMAL, **changes}
    return json.dumps({k: v for k, v in d.items() if v is not ...}).encode()


def invalid(out: object) -> Invalid:
    assert isinstance(out, Invalid), out
    return out


def fields(out: object) -> list[str]:
    return [e["field"] for e in invalid(out).errors]


# --- place: valid ------------------------------------------------------------------------


def test_place_with_every_field() -> None:
    payload = {
        "request_id": "job-4711-attempt-1",
        "gpu": ["H100-80GB", "A100-80GB"],
        "gpus": 8,
        "gang": False,
        "market": "spot",
        "max_price_per_gpu_hour": 3.5,
        "clouds": ["aws", "gcp"],
        "regions": ["us-east-1", "us-central1"],
        "team": "research",
        "duration_hours": 6,
        "lease_seconds": 900,
        "labels": {"job": "llm-pretrain"},
    }
    assert parse_place("sched-a", json.dumps(payload).encode()) == PlaceRequest(
        scheduler="sched-a",
        request_id="job-4711-attempt-1",
        gpu=("H100-80GB", "A100-80GB"),
        gpus=8,
        gang=False,
        market="spot",
        max_price_per_gpu_hour=3.5,
        clouds=("aws", "gcp"),
        regions=("us-east-1", "us-central1"),
        team="research",
        duration_hours=6.0,
        lease_seconds=900,
        labels={"job": "llm-pretrain"},
    )


def test_place_defaults() -> None:
    req = parse_place("sched-a", body())
    assert req == PlaceRequest(scheduler="sched-a", request_id="job-1", gpu=("A100-80GB",),
                               gpus=8)
    assert isinstance(req, PlaceRequest)
    assert req.gang is True
    assert req.market is None  # "the policy's default", decided later
    assert (req.clouds, req.regions, req.labels) == (None, None, {})


@pytest.mark.parametrize(("gpu", "want"), [
    ("T4", ("T4",)),
    (["T4"], ("T4",)),
    (["L4", "T4"], ("L4", "T4")),
    (["L4", "T4", "L4"], ("L4", "T4")),  # duplicates dropped, order kept
])
def test_gpu_is_a_name_or_a_list(gpu: Any, want: tuple[str, ...]) -> None:
    req = parse_place("s", body(gpu=gpu))
    assert isinstance(req, PlaceRequest)
    assert req.gpu == want


def test_unknown_fields_are_ignored() -> None:
    req = parse_place("s", body(priority="high", nested={"x": [1]}))
    assert isinstance(req, PlaceRequest)
    assert req.request_id == "job-1"


def test_integral_numbers_are_accepted_for_prices() -> None:
    req = parse_place("s", body(max_price_per_gpu_hour=4, duration_hours=2))
    assert isinstance(req, PlaceRequest)
    assert req.max_price_per_gpu_hour == 4.0
    assert req.duration_hours == 2.0


def test_request_id_of_128_characters_is_fine() -> None:
    assert isinstance(parse_place("s", body(request_id="x" * 128)), PlaceRequest)


# --- place: invalid ----------------------------------------------------------------------


@pytest.mark.parametrize(("changes", "field"), [
    ({"request_id": ...}, "request_id"),
    ({"request_id": 5}, "request_id"),
    ({"request_id": ""}, "request_id"),
    ({"request_id": "x" * 129}, "request_id"),
    ({"gpu": ...}, "gpu"),
    ({"gpu": 5}, "gpu"),
    ({"gpu": []}, "gpu"),
    ({"gpu": ""}, "gpu"),
    ({"gpu": ["T4"] * 17}, "gpu"),
    ({"gpus": ...}, "gpus"),
    ({"gpus": 0}, "gpus"),
    ({"gpus": -8}, "gpus"),
    ({"gpus": "8"}, "gpus"),
    ({"gpus": 8.5}, "gpus"),
    ({"gpus": True}, "gpus"),
    ({"gpus": 4097}, "gpus"),
    ({"gang": "yes"}, "gang"),
    ({"gang": 1}, "gang"),
    ({"market": "cheap"}, "market"),
    ({"market": ["spot"]}, "market"),
    ({"max_price_per_gpu_hour": 0}, "max_price_per_gpu_hour"),
    ({"max_price_per_gpu_hour": -1.5}, "max_price_per_gpu_hour"),
    ({"max_price_per_gpu_hour": [3]}, "max_price_per_gpu_hour"),
    ({"clouds": "aws"}, "clouds"),
    ({"clouds": []}, "clouds"),
    ({"clouds": [1]}, "clouds.0"),
    ({"regions": [""]}, "regions.0"),
    ({"team": ""}, "team"),
    ({"team": 7}, "team"),
    ({"duration_hours": 0}, "duration_hours"),
    ({"duration_hours": 24 * 367}, "duration_hours"),
    ({"lease_seconds": 0}, "lease_seconds"),
    ({"lease_seconds": 8 * 86400}, "lease_seconds"),
    ({"lease_seconds": 90.5}, "lease_seconds"),
    ({"labels": ["a"]}, "labels"),
    ({"labels": {"a": 1}}, "labels.a"),
    ({"labels": {"a": "x" * 257}}, "labels.a"),
])
def test_each_wrong_value_names_its_field(changes: dict[str, Any], field: str) -> None:
    out = invalid(parse_place("s", body(**changes)))
    assert [e["field"] for e in out.errors] == [field]
    assert all(e["message"] for e in out.errors)


def test_missing_field_says_required() -> None:
    out = invalid(parse_place("s", body(gpus=...)))
    assert out.errors == [{"field": "gpus", "message": "required"}]


def test_gpu_errors_say_what_is_expected() -> None:
    [err] = invalid(parse_place("s", body(gpu=42))).errors
    assert err["field"] == "gpu"
    assert "list" in err["message"] and "name" in err["message"]


def test_every_bad_field_is_reported_once() -> None:
    out = parse_place("s", body(gpus=0, market="cheap", gang="no", gpu=...))
    assert sorted(fields(out)) == ["gang", "gpu", "gpus", "market"]


@pytest.mark.parametrize("number", [float("inf"), float("nan")])
def test_non_finite_price_is_invalid(number: float) -> None:
    payload = body(max_price_per_gpu_hour=number)  # json writes Infinity / NaN
    assert fields(parse_place("s", payload)) == ["max_price_per_gpu_hour"]


@pytest.mark.parametrize(("name", "value"), [
    ("max_price_per_gpu_hour", "3.5"),
    ("max_price_per_gpu_hour", True),
    ("duration_hours", "6"),
    ("duration_hours", True),
])
def test_numbers_given_as_strings_or_booleans_are_invalid(name: str, value: Any) -> None:
    assert fields(parse_place("s", body(**{name: value}))) == [name]


def test_request_id_is_carried_when_readable() -> None:
    assert invalid(parse_place("s", body(gpus=0))).request_id == "job-1"
    assert invalid(parse_place("s", body(request_id=5))).request_id is None
    assert invalid(parse_place("s", body(request_id="x" * 129))).request_id is None
    assert invalid(parse_place("s", body(request_id=...))).request_id is None


@pytest.mark.parametrize("payload", [b"", b"{", b"\xff\xfe", b"not json", b"{'a': 1}"])
def test_bad_json_is_invalid(payload: bytes) -> None:
    out = invalid(parse_place("s", payload))
    assert len(out.errors) == 1
    assert out.errors[0]["field"] == ""
    assert "JSON" in out.errors[0]["message"]
    assert out.request_id is None


@pytest.mark.parametrize("payload", [b"[]", b"[1, 2]", b'"job-1"', b"42", b"null", b"true"])
def test_non_object_json_is_invalid(payload: bytes) -> None:
    out = invalid(parse_place("s", payload))
    assert out.errors == [{"field": "", "message": "expected a JSON object"}]


# --- renew / release ---------------------------------------------------------------------


def test_lease_ref() -> None:
    assert parse_lease_ref(b'{"lease_id": "L-1", "extra": true}') == LeaseRef("L-1")


@pytest.mark.parametrize(("payload", "field"), [
    (b"{}", "lease_id"),
    (b'{"lease_id": 5}', "lease_id"),
    (b'{"lease_id": ""}', "lease_id"),
    (b'{"lease_id": null}', "lease_id"),
    (b"[]", ""),
    (b"nope", ""),
])
def test_bad_lease_ref(payload: bytes, field: str) -> None:
    assert fields(parse_lease_ref(payload)) == [field]


# --- report ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["interrupted", "launch_failed", "unhealthy"])
def test_report_kinds(kind: str) -> None:
    payload = json.dumps({"lease_id": "L-1", "kind": kind, "detail": "xid 79"}).encode()
    assert parse_report(payload) == Report("L-1", kind, "xid 79")


def test_report_detail_is_optional() -> None:
    assert parse_report(b'{"lease_id": "L-1", "kind": "unhealthy"}') == Report(
        "L-1", "unhealthy", None)


@pytest.mark.parametrize(("payload", "field"), [
    ({"kind": "unhealthy"}, ["lease_id"]),
    ({"lease_id": "L-1"}, ["kind"]),
    ({"lease_id": "L-1", "kind": "broken"}, ["kind"]),
    ({"lease_id": "L-1", "kind": "unhealthy", "detail": 5}, ["detail"]),
    ({"lease_id": "L-1", "kind": "unhealthy", "detail": "x" * 1025}, ["detail"]),
    ({"lease_id": 1, "kind": 2}, ["lease_id", "kind"]),
])
def test_bad_report(payload: dict[str, Any], field: list[str]) -> None:
    assert fields(parse_report(json.dumps(payload).encode())) == field


def test_report_bad_json() -> None:
    assert fields(parse_report(b"{")) == [""]
