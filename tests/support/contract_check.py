"""The published contract, checked on every message a test receives from the daemon.

``check(topic, payload)`` says what is wrong with a message on one of the daemon's topics
(``<prefix>/status``, ``/events/...``, ``/leases/...``, ``/capacity/...``,
``/replies/...``), or ``None``: it is not a daemon topic, or the message follows the
contract. Each topic has its schema of ``docs/schemas/`` (``broker.wire.contract``), closed to
keys the contract does not name (``strict=True``): a field the daemon sends that the
contract does not know fails the test as much as a missing or mistyped one. Requests are
not checked (tests send invalid ones on purpose).

The prefix is not configured: a topic is matched with the shortest prefix that makes it
one of the daemon's, so a daemon on ``gpubroker-demo/x/v1`` is checked as well.

Which messages are the daemon's: every message on those topics, except one a test put
there itself through an ``MqttProbe`` (``note_published``) — tests publish stale
retained states, markers and forged messages on the daemon's topics; what they published
is recognised by its topic and bytes, so the rest is held to the contract whatever it
says about itself. A client that must receive other junk on those topics opts out with
``MqttProbe(check_contract=False)``.

Used by ``tests/support/mqtt_helpers.py`` (``MqttProbe``) and ``tests/chaos/harness.py``
(``MqttClient``).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

from broker.wire import contract, payloads

_ROUTES = (
    ("status", re.compile(r"^(?P<prefix>.+?)/status$")),
    ("ops", re.compile(r"^(?P<prefix>.+?)/events/_ops/(?P<kind>[^/]+)$")),
    ("event", re.compile(r"^(?P<prefix>.+?)/events/(?P<scheduler>[^/]+)/(?P<kind>[^/]+)$")),
    ("lease", re.compile(r"^(?P<prefix>.+?)/leases/(?P<scheduler>[^/]+)/(?P<lease>[^/]+)$")),
    ("capacity", re.compile(r"^(?P<prefix>.+?)/capacity/[^/]+/[^/]+/[^/]+$")),
    ("reply", re.compile(r"^(?P<prefix>.+?)/replies/(?P<scheduler>[^/]+)/.+$")),
)

# Messages tests published on the daemon's topics, by (topic, payload): not the daemon's.
# Process-wide on purpose: the probe that publishes is seldom the one that receives.
_PUBLISHED_BY_TESTS: set[tuple[str, bytes]] = set()


def note_published(topic: str, payload: bytes) -> None:
    """A test client published this: whoever receives it, it is not checked."""
    if route(topic) is not None:
        _PUBLISHED_BY_TESTS.add((topic, bytes(payload)))


def route(topic: str) -> tuple[str, dict[str, str]] | None:
    """Which of the daemon's topics this is (and its levels), with the shortest prefix;
    None for any other topic (requests included)."""
    best: tuple[int, int, str, dict[str, str]] | None = None
    for rank, (name, pattern) in enumerate(_ROUTES):
        m = pattern.match(topic)
        if m is not None and (best is None or (len(m["prefix"]), rank) < best[:2]):
            best = (len(m["prefix"]), rank, name, m.groupdict())
    return None if best is None else (best[2], best[3])


@functools.cache
def validator(name: str) -> Any:
    """The compiled validator of schema `name`, closed to unknown keys."""
    schema = contract.schema(name, strict=True)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def problem(name: str, doc: Any) -> str | None:
    """Why `doc` does not follow schema `name`, or None."""
    error = best_match(validator(name).iter_errors(doc))
    if error is None:
        return None
    where = error.json_path if error.path else "the payload"
    return f"docs/schemas/{name}.schema.json: {where}: {error.message[:300]}"


def check(topic: str, payload: bytes) -> str | None:
    """What is wrong with this message, if it is the daemon's and breaks the contract."""
    found = route(topic)
    if found is None or (topic, payload) in _PUBLISHED_BY_TESTS:
        return None
    kind, levels = found
    why = _check(kind, levels, payload)
    if why is None:
        return None
    shown = payload[:400].decode("utf-8", errors="replace")
    return f"{topic}: {why}\n    payload: {shown}{' ...' if len(payload) > 400 else ''}"


def _check(kind: str, levels: dict[str, str], payload: bytes) -> str | None:
    if kind == "lease" and payload == b"":
        return None  # the lease ended: its retained state is cleared
    try:
        doc = json.loads(payload)
    except ValueError as exc:  # also UnicodeDecodeError
        return f"not JSON: {exc}"
    if kind == "status":
        return problem("status", doc)
    if kind == "capacity":
        return problem("capacity", doc)
    if kind == "lease":
        why = problem("lease-state", doc)
        if why is None and (doc["scheduler"], doc["lease_id"]) != (levels["scheduler"],
                                                                   levels["lease"]):
            why = "the topic's scheduler and lease id are not the payload's"
        if why is None and doc["state"] != "active":
            why = "a retained lease state is `active`; an ended lease is an empty payload"
        return why
    if kind == "reply":
        event = doc.get("type") if isinstance(doc, dict) else None
        kinds = {payloads.event_type(k): k for k in payloads.REPLY_EVENT_TYPES}
        if event not in kinds:
            return f"a reply is one of the answer events {sorted(kinds)}; `type` is {event!r}"
        return problem(f"event.{kinds[event]}", doc)
    known = payloads.OPS_EVENT_TYPES if kind == "ops" else payloads.EVENT_TYPES
    if levels["kind"] not in known:
        return f"no event type {levels['kind']!r} on this topic in the contract"
    return problem(f"event.{levels['kind']}", doc)
