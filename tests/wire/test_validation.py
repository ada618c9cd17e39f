"""Tests of the validation of what schedulers send (`broker/wire/validation.py`)."""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from broker.model import PlaceRequest
from broker.wire.messages import dumps
from broker.wire.validation import (
    MAX_DEPTH,
    MAX_PAYLOAD,
    Invalid,
    LeaseRef,
    Report,
    _too_deep,
    parse_lease_ref,
    parse_place,
    parse_report,
    unknown_gpus,
)

# See tests/placement/test_optimizer_properties.py: keeps a failing example readable.
with contextlib.suppress(ImportError), warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import hypothesis.extra._patching  # noqa: F401

NASTY = Path(__file__).parent.parent / "fixtures" / "nasty"
CORPUS = sorted(p for p in NASTY.iterdir() if p.suffix in (".bad", ".ok"))
FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

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


# --- hostile payloads: the decoder is total ----------------------------------------------


def test_the_corpus_is_there() -> None:
    assert sum(p.suffix == ".bad" for p in CORPUS) >= 80
    assert sum(p.suffix == ".ok" for p in CORPUS) >= 20


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.name)
def test_corpus_payload(path: Path) -> None:
    payload = path.read_bytes()
    out = parse_place("s", payload)
    if path.suffix == ".ok":
        assert isinstance(out, PlaceRequest), out
    elif isinstance(out, PlaceRequest):  # well formed, but no such GPU model (the broker)
        refused = unknown_gpus(out, lambda: ())
        assert refused is not None and refused.errors[0]["field"] == "gpu", path.name
    else:
        assert isinstance(out, Invalid) and out.errors
    for other in (parse_lease_ref(payload), parse_report(payload)):
        assert isinstance(other, Invalid) and other.errors  # none has a lease_id
    for result in (out, parse_lease_ref(payload), parse_report(payload)):
        assert_encodable(result)


def assert_encodable(out: object) -> None:
    """Whatever the parser gives back can go into an event and into SQLite."""
    if isinstance(out, Invalid):
        assert all(set(e) == {"field", "message"} for e in out.errors)
        assert out.request_id is None or 0 < len(out.request_id) <= 128
        json.dumps([out.errors, out.request_id], ensure_ascii=False).encode()
    else:
        assert isinstance(out, PlaceRequest | LeaseRef | Report)
        json.dumps(repr(out), ensure_ascii=False).encode()


def test_too_large_is_answered_before_parsing() -> None:
    head = b'{"request_id":"big","gpu":"A100-80GB","gpus":1,"pad":"'
    exact = head + b"x" * (MAX_PAYLOAD - len(head) - 2) + b'"}'
    assert len(exact) == MAX_PAYLOAD
    assert isinstance(parse_place("s", exact), PlaceRequest)
    over = exact[:-2] + b'x"}'
    assert invalid(parse_place("s", over)).errors == [
        {"field": "", "message": "too large: 65537 bytes (at most 65536)"}]
    for parse in (parse_lease_ref, parse_report):
        assert invalid(parse(over)).errors[0]["message"].startswith("too large")
    # Not even JSON: the size is all that is looked at.
    assert "too large" in invalid(parse_place("s", b"[" * 70_000)).errors[0]["message"]


@pytest.mark.parametrize("payload", [b"[" * 10_000, b"{" * 10_000,
                                     b"[" * 10_000 + b"]" * 10_000,
                                     b'{"a":' * 10_000 + b"1" + b"}" * 10_000])
def test_deep_nesting_is_invalid_not_a_recursion_error(payload: bytes) -> None:
    [err] = invalid(parse_place("s", payload)).errors
    assert err["field"] == ""
    assert "nested deeper" in err["message"] or "brackets do not match" in err["message"]


def test_nesting_limit_is_exact_and_strings_do_not_count() -> None:
    def at(depth: int) -> bytes:  # the request itself is one level
        return body(x=..., gpus=1)[:-1] + b',"x":' + b"[" * (depth - 1) + b"]" * (
            depth - 1) + b"}"
    assert isinstance(parse_place("s", at(MAX_DEPTH)), PlaceRequest)
    assert invalid(parse_place("s", at(MAX_DEPTH + 1))).errors == [
        {"field": "", "message": f"nested deeper than {MAX_DEPTH} levels"}]
    assert isinstance(parse_place("s", body(x="[{" * 10_000, y='\\"]' * 100)),
                      PlaceRequest)


@pytest.mark.parametrize(("payload", "field"), [
    (body()[:-1] + b',"z":' + b"9" * 5_000 + b"}", "z"),  # an unknown field too
    (body(gpus=...)[:-1] + b',"gpus":' + b"1" * 5_000 + b"}", "gpus"),
    (body()[:-1] + b',"labels":{"a":-' + b"1" * 4_301 + b"}}", "labels.a"),
    (body()[:-1] + b',"duration_hours":1e' + b"9" * 5_000 + b"}", "duration_hours"),
    (body()[:-1] + b',"z":[0,1e' + b"9" * 65 + b']}', "z.1"),
    (body()[:-1] + b',"z":-Infinity}', "z"),
    (body()[:-1] + b',"x":{"y":[NaN]}}', "x.y.0"),
    (body(gpus=...)[:-1] + b',"gpus":NaN}', "gpus"),
])
def test_numbers_too_long_or_not_finite_name_their_field(payload: bytes, field: str) -> None:
    out = invalid(parse_place("s", payload))
    assert out.errors[0]["field"] == field
    assert "not accepted" in out.errors[0]["message"]
    assert out.request_id == "job-1"


@pytest.mark.parametrize(("payload", "field"), [
    (rb'{"request_id":"\ud800","gpu":"T4","gpus":1}', "request_id"),
    (rb'{"request_id":"ok","gpu":["T4","\udfff"],"gpus":1}', "gpu.1"),
    (rb'{"request_id":"ok","gpu":"T4","gpus":1,"labels":{"\ud800":"v"}}', "labels"),
    (rb'{"request_id":"ok","gpu":"T4","gpus":1,"labels":{"k":"a\uDC00"}}', "labels.k"),
    (rb'{"request_id":"ok","gpu":"T4","gpus":1,"x":[{"y":"\ude00\ud83d"}]}', "x.0.y"),
])
def test_lone_surrogates_are_invalid_and_named(payload: bytes, field: str) -> None:
    out = invalid(parse_place("s", payload))
    assert out.errors[0]["field"] == field
    assert "lone surrogate" in out.errors[0]["message"]
    assert out.request_id in (None, "ok")
    assert_encodable(out)


def test_a_surrogate_pair_is_a_character() -> None:
    req = parse_place("s", rb'{"request_id":"\ud83d\ude00","gpu":"T4","gpus":1}')
    assert isinstance(req, PlaceRequest) and req.request_id == "\U0001f600"


@pytest.mark.parametrize("payload", [
    b'{"request_id":"\xff","gpu":"T4","gpus":1}',
    b'{"request_id":"\xc0\xaf","gpu":"T4","gpus":1}',  # overlong "/"
    b'{"request_id":"\xed\xa0\x80","gpu":"T4","gpus":1}',  # an encoded surrogate
    b'\xef\xbb\xbf{"request_id":"a","gpu":"T4","gpus":1}',  # a byte order mark
    '{"request_id":"a","gpu":"T4","gpus":1}'.encode("utf-16"),
])
def test_only_utf8_json(payload: bytes) -> None:
    [err] = invalid(parse_place("s", payload)).errors
    assert err["field"] == "" and "not valid JSON" in err["message"]


def test_an_invalid_request_id_is_not_echoed() -> None:
    assert invalid(parse_place("s", rb'{"request_id":"\ud800","gpu":"T4"}')).request_id \
        is None
    assert invalid(parse_place("s", body(request_id="", gpus=0))).request_id is None
    assert invalid(parse_place("s", body(request_id="r" * 129, gpus=0))).request_id is None


VALID = body(labels={"k": "v"}, gpu=["T4", "L4"])


@FUZZ
@given(st.binary(max_size=300))
@example(b"[" * 10_000)
@example(b"1" * 5_000)
@example(b'"\\ud800"')
def test_any_bytes(payload: bytes) -> None:
    for parse in (lambda p: parse_place("s", p), parse_lease_ref, parse_report):
        out = parse(payload)
        assert isinstance(out, PlaceRequest | LeaseRef | Report | Invalid)
        assert_encodable(out)


@FUZZ
@given(st.data())
def test_any_mutation_of_a_valid_request(data: st.DataObject) -> None:
    """Bytes of a valid request replaced, inserted or deleted, many times over."""
    payload = bytearray(VALID)
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(payload)))
        new = data.draw(st.sampled_from([b"[", b"{", b"]", b"}", b'"', b"\\", b"\\ud800",
                                         b"9" * 5_000, b"\xff", b"\x00", b",", b":"])
                        | st.binary(max_size=4))
        cut = data.draw(st.integers(0, 3))
        payload[at:at + cut] = new
    out = parse_place("s", bytes(payload))
    assert isinstance(out, PlaceRequest | Invalid)
    assert_encodable(out)


TEXT = st.text(st.characters(codec=None), max_size=12)  # surrogates included
LEAVES = st.none() | st.booleans() | st.integers() | st.floats() | TEXT
TREES = st.recursive(LEAVES, lambda kids: st.lists(kids, max_size=4)
                     | st.dictionaries(TEXT, kids, max_size=4), max_leaves=20)
FIELDS = st.sampled_from(["request_id", "gpu", "gpus", "gang", "market", "labels", "team",
                          "clouds", "regions", "lease_seconds", "duration_hours",
                          "max_price_per_gpu_hour", "x"])


@FUZZ
@given(st.dictionaries(FIELDS, TREES, max_size=6), st.booleans())
def test_any_json_tree(tree: dict[str, Any], ascii_only: bool) -> None:
    """JSON-ish trees of any text: lone surrogates come as `\\udxxx` escapes (json
    writes them so), NaN and Infinity as json writes them."""
    payload = json.dumps({**json.loads(VALID), **tree}, ensure_ascii=ascii_only)
    out = parse_place("s", payload.encode("utf-8", "surrogatepass"))
    assert isinstance(out, PlaceRequest | Invalid)
    assert_encodable(out)
    assert dumps({"errors": getattr(out, "errors", None), "id": getattr(
        out, "request_id", None)}).decode("utf-8")


def depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    return 0


STRINGS = st.text(st.sampled_from('[]{}"\\ax'), max_size=8)


@st.composite
def nested(draw: st.DrawFn) -> Any:
    """A tree of arrays and objects around 32 levels deep, with bracket-filled strings."""
    value: Any = draw(STRINGS)
    for _ in range(draw(st.integers(0, MAX_DEPTH + 3))):
        siblings = draw(st.lists(STRINGS, max_size=2))
        if draw(st.booleans()):
            value = [*siblings, value]
        else:
            value = {**{s: s for s in siblings}, draw(STRINGS): value}
    return value


@FUZZ
@given(nested())
def test_the_depth_check_agrees_with_the_real_depth(tree: Any) -> None:
    payload = json.dumps(tree).encode()
    assert (_too_deep(payload) is None) == (depth(tree) <= MAX_DEPTH)


def test_a_number_too_large_for_a_float_is_refused_where_a_number_is_expected() -> None:
    payload = body()[:-1] + b',"max_price_per_gpu_hour":1e400,"z":-1e999}'
    assert fields(parse_place("s", payload)) == ["max_price_per_gpu_hour"]
    assert isinstance(parse_place("s", body()[:-1] + b',"z":1e400}'), PlaceRequest)
