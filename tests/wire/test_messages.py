"""Tests of topics and the CloudEvents envelope (`broker/wire/messages.py`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import uuid
import warnings
from dataclasses import replace
from typing import Any

import pytest
from factories import T0, Clock, offer, placement, request
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from broker.leasing.book import LeaseBook
from broker.model import Event, Lease, LeaseState, parse_iso
from broker.wire.messages import (
    Envelopes,
    Messages,
    Topics,
    dumps,
    lease_subject,
    request_subject,
)

# See tests/placement/test_optimizer_properties.py: keeps a failing example readable.
with contextlib.suppress(ImportError), warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import hypothesis.extra._patching  # noqa: F401

P = "gpubroker/v1"
BOOT = "5f0c6a52-8f3e-4c43-9a3d-4d1e1b7f9a10"


def decided_event(correlationid: str | None = "job-1") -> Event:
    return Event(kind="placement.decided", scheduler="sched-a",
                 data={"request_id": "job-1", "lease_id": "L-1", "epoch": 1},
                 subject=lease_subject("L-1"), correlationid=correlationid)


def messages(clock: Clock | None = None) -> Messages:
    return Messages(Topics(P), Envelopes("lab-1", BOOT, clock=clock or Clock()))


def a_lease() -> Lease:
    return LeaseBook().create(request("job-1", scheduler="sched-a"), placement(offer(), 1),
                              lease_seconds=900, cap=None, now=T0)


# --- topics ------------------------------------------------------------------------------


def test_topics() -> None:
    t = Topics(P)
    assert t.status == "gpubroker/v1/status"
    assert t.requests == "gpubroker/v1/requests/+/+"
    assert t.event("sched-a", "placement.decided") == (
        "gpubroker/v1/events/sched-a/placement.decided")
    assert t.lease("sched-a", "L-1") == "gpubroker/v1/leases/sched-a/L-1"
    assert t.capacity("aws", "us-east-1", "H100-80GB") == (
        "gpubroker/v1/capacity/aws/us-east-1/H100-80GB")


def test_a_trailing_slash_on_the_prefix_is_dropped() -> None:
    assert Topics("site/gpubroker/").status == "site/gpubroker/status"


@pytest.mark.parametrize(("name", "level"), [
    ("a/b", "a_b"), ("a+b", "a_b"), ("a#b", "a_b"), ("+/#", "___"), ("", "_"),
    ("H100-80GB", "H100-80GB"),
])
def test_capacity_topic_levels_are_sanitised(name: str, level: str) -> None:
    t = Topics(P)
    assert t.capacity(name, name, name) == f"{P}/capacity/{level}/{level}/{level}"


@pytest.mark.parametrize(("topic", "want"), [
    (f"{P}/requests/sched-a/place", ("sched-a", "place")),
    (f"{P}/requests/sched-a/renew", ("sched-a", "renew")),
    (f"{P}/requests/sched-a", None),
    (f"{P}/requests/sched-a/place/extra", None),
    (f"{P}/requests", None),
    (f"{P}/events/sched-a/place", None),
    ("other/requests/sched-a/place", None),
    (f"{P}x/requests/sched-a/place", None),
    (f"x/{P}/requests/sched-a/place", None),
])
def test_parse_request(topic: str, want: tuple[str, str] | None) -> None:
    assert Topics(P).parse_request(topic) == want


# --- the envelope ------------------------------------------------------------------------


def test_envelope_has_every_cloudevents_field() -> None:
    clock = Clock(T0.replace(microsecond=123456))
    env = Envelopes("lab-1", BOOT, clock=clock).build(decided_event())
    assert list(env) == ["specversion", "id", "source", "type", "time", "subject",
                         "datacontenttype", "seq", "bootid", "leaderepoch", "schedseq",
                         "correlationid", "data"]
    assert env["specversion"] == "1.0"
    uuid.UUID(env["id"])
    assert env["source"] == "gpubroker://lab-1"
    assert env["type"] == "gpubroker.placement.decided.v1"
    assert env["time"] == "2026-11-30T12:00:00.123Z"
    assert env["subject"] == "lease/L-1"
    assert env["datacontenttype"] == "application/json"
    assert env["seq"] == 1
    assert env["bootid"] == BOOT
    assert env["correlationid"] == "job-1"
    assert env["data"] == {"request_id": "job-1", "lease_id": "L-1", "epoch": 1}
    assert env["leaderepoch"] == 0  # a single daemon (no leader election)


def test_leaderepoch_is_the_fencing_epoch_when_the_event_is_built() -> None:
    """The envelope carries the leader's epoch as it is when the event is built; the
    bytes stored in the outbox keep it, whatever the epoch is when they are sent."""
    epoch = 3
    envelopes = Envelopes("lab-1", BOOT, epoch=lambda: epoch)
    messages = Messages(Topics(P), envelopes)
    first = messages.event(decided_event())[0].payload
    epoch = 4
    second = envelopes.build(decided_event())
    assert json.loads(first)["leaderepoch"] == 3
    assert second["leaderepoch"] == 4


def test_schedseq_is_taken_per_scheduler_when_committed() -> None:
    """Numbered at the commit (`sequence`), per scheduler, from the last kept number; the
    reply copy of an event gets the same bytes; an event built and dropped before its
    commit takes no number; `_ops` events and lease states have none."""
    msgs = Messages(Topics(P), Envelopes("lab-1", BOOT))
    msgs.schedseqs = {"a": 7}
    msgs.event(dataclasses.replace(decided_event(), scheduler="a"))  # never committed
    reply = {"response_topic": f"{P}/replies/a/x", "correlation_data": "01"}
    rows = [*msgs.event(dataclasses.replace(decided_event(), scheduler="a"), reply),
            *msgs.event(dataclasses.replace(decided_event(), scheduler="b")),
            *msgs.event(Event("policy.applied", "_ops", {}, "policy")),
            *msgs.event(dataclasses.replace(decided_event(), scheduler="a"))]
    numbered, last, renumbered = msgs.sequence(rows)
    seqs = [json.loads(r.payload).get("schedseq") for r in numbered]
    assert seqs == [8, 8, 1, None, 9]
    assert numbered[0].payload == numbered[1].payload
    assert renumbered[id(rows[0].payload)] == numbered[0].payload
    assert last == {"a": 9, "b": 1}
    assert msgs.schedseqs == {"a": 7}  # kept only once committed
    msgs.commit_sequence(last)
    assert msgs.schedseqs == {"a": 9, "b": 1}


def test_correlationid_is_left_out_when_there_is_none() -> None:
    env = Envelopes("lab-1", BOOT).build(decided_event(correlationid=None))
    assert "correlationid" not in env


def test_seq_counts_up_by_one_ids_are_unique_bootid_is_constant() -> None:
    envelopes = Envelopes("lab-1", BOOT)
    built = [envelopes.build(decided_event()) for _ in range(100)]
    assert [e["seq"] for e in built] == list(range(1, 101))
    assert envelopes.last_seq == 100
    assert len({e["id"] for e in built}) == 100
    assert {e["bootid"] for e in built} == {BOOT}


def test_a_new_boot_starts_seq_again() -> None:
    first = Envelopes("lab-1", BOOT)
    first.build(decided_event())
    again = Envelopes("lab-1", str(uuid.uuid4()))
    assert again.last_seq == 0
    assert again.build(decided_event())["seq"] == 1


# --- messages ----------------------------------------------------------------------------


def test_event_message_is_the_envelope_on_the_schedulers_topic() -> None:
    [row] = messages().event(decided_event())
    assert row.topic == f"{P}/events/sched-a/placement.decided"
    assert (row.qos, row.retain, row.props) == (1, False, None)
    env = json.loads(row.payload)
    assert env["type"] == "gpubroker.placement.decided.v1"
    assert env["seq"] == 1


def test_event_with_a_reply_copies_it_to_the_response_topic() -> None:
    reply = {"response_topic": "replies/sched-a/42", "correlation_data": "00ff"}
    event_row, reply_row = messages().event(decided_event(), reply)
    assert reply_row.topic == "replies/sched-a/42"
    assert reply_row.payload == event_row.payload  # the same event: same id and seq
    assert reply_row.props == reply
    assert (reply_row.qos, reply_row.retain) == (1, False)
    assert event_row.props is None


def test_each_event_message_gets_the_next_seq() -> None:
    m = messages()
    seqs = [json.loads(m.event(decided_event())[0].payload)["seq"] for _ in range(3)]
    assert seqs == [1, 2, 3]


def test_payload_is_compact_utf8_json() -> None:
    event = replace(decided_event(), data={"detail": "zone ü"})
    [row] = messages().event(event)
    assert "zone ü".encode() in row.payload
    assert b": " not in row.payload and b", " not in row.payload


def test_lease_state_is_retained_with_the_lease() -> None:
    lease = a_lease()
    row = messages().lease_state(lease)
    assert row.topic == f"{P}/leases/sched-a/{lease.lease_id}"
    assert row.retain is True
    assert row.qos == 1
    body: dict[str, Any] = json.loads(row.payload)
    assert body == lease.to_json()
    assert body["state"] == "active"
    assert body["epoch"] == 1
    assert parse_iso(body["expires_at"]) == lease.expires_at


@pytest.mark.parametrize("final", [LeaseState.RELEASED, LeaseState.EXPIRED, LeaseState.FAILED])
def test_ended_lease_clears_its_retained_state(final: LeaseState) -> None:
    lease = replace(a_lease(), state=final)
    row = messages().lease_state(lease)
    assert row.topic == f"{P}/leases/sched-a/{lease.lease_id}"
    assert (row.payload, row.retain) == (b"", True)


def test_subjects() -> None:
    assert lease_subject("L-1") == "lease/L-1"
    assert request_subject("job-1") == "request/job-1"
    assert request_subject(None) == "request"


# --- any text encodes ----------------------------------------------------------------------

FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
TEXT = st.text(st.characters(codec=None))  # lone surrogates included
LEAVES = st.none() | st.booleans() | st.integers() | TEXT \
    | st.floats(allow_nan=False, allow_infinity=False)
TREES = st.recursive(LEAVES, lambda kids: st.lists(kids, max_size=4)
                     | st.dictionaries(TEXT, kids, max_size=4), max_leaves=20)


def has_surrogate(text: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def test_dumps_replaces_lone_surrogates() -> None:
    out = dumps({"request_id": "\ud800", "k\udfff": ["ok \u00fc", "\ud83d\ude00"]})
    assert json.loads(out.decode("utf-8")) == {
        "request_id": "\ufffd", "k\ufffd": ["ok \u00fc", "\ufffd\ufffd"]}
    assert dumps({"a": "ü"}) == '{"a":"ü"}'.encode()  # the fast path: plain UTF-8


@FUZZ
@given(TREES)
@example({"request_id": "\ud800"})
@example(["\udc00\ud800", {"\udfff": "x"}])
def test_dumps_never_fails_and_is_utf8_json(tree: Any) -> None:
    out = dumps(tree)
    text = out.decode("utf-8")  # strict: raises on anything but UTF-8
    back = json.loads(text)
    if not has_surrogate(json.dumps(tree, ensure_ascii=False)):
        assert back == tree


@FUZZ
@given(TEXT, TEXT, TREES)
def test_every_event_message_is_utf8_json(scheduler: str, request_id: str, data: Any) -> None:
    event = Event("request.invalid", "sched-a", {"request_id": request_id, "data": data,
                                                  "errors": [{"field": scheduler,
                                                              "message": request_id}]},
                  request_subject(request_id), request_id)
    reply = {"response_topic": f"{P}/replies/sched-a/1", "correlation_data": "00"}
    for row in messages().event(event, reply):
        env = json.loads(row.payload.decode("utf-8"))
        assert env["type"] == "gpubroker.request.invalid.v1"


def test_dumps_writes_what_the_standard_library_writes_and_survives_what_orjson_refuses(
) -> None:
    """The fast path (orjson) and the fallback (json) agree byte for byte (but for the
    exponent of very small or large floats: 1e-7, not 1e-07) and always in value; a lone
    surrogate and an integer beyond 64 bits, which orjson refuses, still encode."""
    import json

    from broker.wire.messages import dumps

    doc = {"a": 1, "b": [1.5, 0.1, 123456789.125, None, True], "c": "é ☃ \u2028",
           "d": {"nested": "x" * 300}}
    assert dumps(doc) == json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    tiny = {"x": 1e-7, "y": 1.5e300}
    assert json.loads(dumps(tiny)) == tiny
    assert json.loads(dumps({"s": "bad \udc80 text"})) == {"s": "bad \ufffd text"}
    assert json.loads(dumps({"n": 2**70})) == {"n": 2**70}
