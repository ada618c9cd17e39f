"""The machine-readable contract: JSON Schemas and an AsyncAPI document, from the code.

`docs/schemas/<name>.schema.json` (JSON Schema draft 2020-12) is generated for every
payload type of `broker.wire.payloads`, and `docs/asyncapi.yaml` (AsyncAPI 3.0.0) describes the
MQTT API — channels, the daemon's operations, messages — referring to those schemas. Both
come from here only:

    python -m broker.wire.contract            # write docs/schemas/ and docs/asyncapi.yaml
    python -m broker.wire.contract --check    # exit 1 and name each file that differs

`tests/wire/test_contract.py` fails on any difference, so a change to a payload type
without regenerating cannot land. `docs/contract.md` is the prose contract.

Schemas of what the daemon sends are published *open*: `additionalProperties` is left out,
since a later version may add fields (docs/contract.md "Compatibility"). `schema(name,
strict=True)` adds `additionalProperties: false` where the types forbid other keys: the
tests validate every message they receive from the daemon that way, so a field the code
sends but the contract does not name fails them. Request schemas are open either way:
the daemon ignores fields it does not know.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter

from broker import __version__
from broker.model import CLOUDS
from broker.wire import payloads
from broker.wire.validation import MAX_PACKET, MAX_PAYLOAD

DIALECT = "https://json-schema.org/draft/2020-12/schema"
ID_PREFIX = "urn:gpubroker:v1:schema:"
"""`$id` of schema `name` is this + name: a URN, since the schemas have no home on the
web; they refer to nothing outside themselves."""
PREFIX = "gpubroker/v1"
"""The default topic prefix `P` (config `mqtt.topic_prefix`); AsyncAPI addresses use it."""
SCHEMA_FORMAT = "application/schema+json;version=draft-2020-12"
WILL_EXAMPLE = {"state": "offline", "ts": "2026-11-30T12:00:00.000Z",
                "boot_id": "4b7e2f10-9c3d-4e5a-8b6f-0a1c2d3e4f50", "version": __version__,
                "node": "broker-a", "role": "leader", "epoch": 3}
"""An example of the daemon's MQTT will (a `status`; its `ts` is when the connection was
made): the AsyncAPI server binding's `lastWill` message."""
DOCS = Path(__file__).resolve().parents[2] / "docs"


@dataclass(frozen=True, slots=True)
class Payload:
    """One published schema: `docs/schemas/<name>.schema.json`."""

    name: str
    type: Any  # a pydantic model or a TypedDict of broker.wire.payloads
    title: str
    sent: bool  # sent by the daemon (else received: a request)


def _event_name(kind: str) -> str:
    return f"event.{kind}"


PAYLOADS: tuple[Payload, ...] = (
    Payload("request.place", payloads.PlacePayload, "Placement request", sent=False),
    Payload("request.renew", payloads.LeaseRefPayload, "Renew request", sent=False),
    Payload("request.release", payloads.ReleasePayload, "Release request", sent=False),
    Payload("request.report", payloads.ReportPayload, "Report request", sent=False),
    Payload("request.quote", payloads.QuotePayload, "Quote request", sent=False),
    Payload("request.lookup", payloads.LookupPayload, "Lookup request", sent=False),
    Payload("event", payloads.CloudEvent, "Event (CloudEvents 1.0 envelope)", sent=True),
    *(Payload(_event_name(kind), t, f"Event {kind}", sent=True)
      for kind, t in payloads.EVENTS.items()),
    Payload("placement", payloads.PlacementJson, "Placement", sent=True),
    Payload("lease-state", payloads.LeaseStateJson, "Lease state", sent=True),
    Payload("status", payloads.Status, "Daemon status", sent=True),
    Payload("capacity", payloads.CapacitySummary, "Capacity summary", sent=True),
    Payload("offer", payloads.OfferJson, "Offer", sent=True),
)
BY_NAME = {p.name: p for p in PAYLOADS}


def schema(name: str, *, strict: bool = False) -> dict[str, Any]:
    """The JSON Schema of payload `name`; `strict`: closed to keys the types do not name
    (for tests: only the schemas of what the daemon sends differ)."""
    p = BY_NAME[name]
    body: dict[str, Any] = _tidy(TypeAdapter(p.type).json_schema())
    if p.sent and not strict:
        body = _open(body)
    head: dict[str, Any] = {"$schema": DIALECT, "$id": ID_PREFIX + name, "title": p.title}
    body.pop("title", None)
    description = body.pop("description", None)
    if description:
        head["description"] = description
    return head | body


def _tidy(node: Any) -> Any:
    """Drop the titles pydantic makes up for properties (`"Lease Id"`): the property
    names say it. Docstrings' line breaks within a paragraph become spaces."""
    if isinstance(node, dict):
        out = {k: _tidy(v) for k, v in node.items()}
        if isinstance(out.get("description"), str):
            out["description"] = re.sub(r"(?<!\n)\n(?!\n)", " ", out["description"])
        props = out.get("properties")
        if isinstance(props, dict):
            for prop in props.values():
                if isinstance(prop, dict):
                    prop.pop("title", None)
        return out
    if isinstance(node, list):
        return [_tidy(v) for v in node]
    return node


def _open(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _open(v) for k, v in node.items()
                if not (k == "additionalProperties" and v is False)}
    if isinstance(node, list):
        return [_open(v) for v in node]
    return node


# --- AsyncAPI ---------------------------------------------------------------------------


def _ref(path: str) -> dict[str, str]:
    return {"$ref": path}


def _payload(name: str) -> dict[str, Any]:
    return {"schemaFormat": SCHEMA_FORMAT, "schema": _ref(f"./schemas/{name}.schema.json")}


_MQTT = {"bindingVersion": "0.2.0"}


def _message(name: str, title: str, summary: str, *, correlation: str | None = None,
             description: str | None = None, bindings: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    m: dict[str, Any] = {"name": name, "title": title, "summary": summary}
    if description:
        m["description"] = description
    m["contentType"] = "application/json"
    if correlation:
        m["correlationId"] = {"location": f"$message.payload#/{correlation}"}
    m["payload"] = _payload(name)
    if bindings:
        m["bindings"] = {"mqtt": bindings | _MQTT}
    return m


_EVENT_SUMMARY = {
    "placement.decided": "A lease: the answer to a placement request and to every repetition.",
    "placement.rejected": "No placement now, with the constraint that binds.",
    "placement.quoted": "What a placement request would get now and its expected cost; "
                        "nothing held.",
    "request.invalid": "A request that was not executed, with every problem found.",
    "lease.renewed": "The lease runs until its new expires_at.",
    "lease.released": "The lease has ended: released by the scheduler.",
    "lease.expired": "The lease has ended: not renewed in time.",
    "lease.failover": "The lease moved to another placement; its epoch grew by one.",
    "lease.failed": "A failover found nowhere to go; the lease has ended.",
    "lease.current": "A renew, release or report with an older epoch: nothing done; the "
                     "lease as it is now.",
    "report.declined": "A report the anti-flap limits hold back: the lease stays, at its "
                       "epoch.",
    "policy.applied": "A policy file is in force.",
    "policy.rejected": "A policy file was refused; the running policy stays.",
}
_REQUEST_SUMMARY = {
    "place": "Ask for GPUs. Answered by placement.decided, placement.rejected or "
             "request.invalid.",
    "renew": "Extend a lease by its lease_seconds. Answered by lease.renewed (lease.current "
             "for an older epoch).",
    "release": "End a lease, by lease_id or by request_id. Answered by lease.released "
               "(lease.current for an older epoch).",
    "report": "The lease's capacity failed. Answered by lease.failover or lease.failed "
              "(report.declined when the anti-flap limits hold it back, lease.current for "
              "an older epoch).",
    "quote": "What a placement request would get now, holding nothing. Answered by "
             "placement.quoted or request.invalid.",
    "lookup": "The lease placed with a request_id, as it is now; places nothing. Answered "
              "by placement.decided or request.invalid.",
}
_ANSWERS = {
    "place": ("placement.decided", "placement.rejected", "request.invalid"),
    "renew": ("lease.renewed", "lease.expired", "lease.released", "lease.failed",
              "lease.current", "request.invalid"),
    "release": ("lease.released", "lease.expired", "lease.failed", "lease.current",
                "request.invalid"),
    "report": ("lease.failover", "lease.failed", "lease.expired", "lease.released",
               "lease.current", "report.declined", "request.invalid"),
    "quote": ("placement.quoted", "request.invalid"),
    "lookup": ("placement.decided", "request.invalid"),
}


def _camel(*parts: str) -> str:
    words = [w for p in parts for w in re.split(r"[._-]", p) if w]
    return words[0] + "".join(w[:1].upper() + w[1:] for w in words[1:])


def asyncapi() -> dict[str, Any]:
    """The AsyncAPI 3.0.0 document of the MQTT API, from the daemon's point of view."""
    P = PREFIX
    request_props = {"responseTopic": {
        "type": "string", "description":
            f"MQTT 5: the answer is also published here, but only under "
            f"`{P}/replies/{{scheduler}}/` (anything else is ignored and logged)."},
        "correlationData": {"type": "string", "description":
                            "MQTT 5: copied to the answer sent to the ResponseTopic."}}
    messages: dict[str, Any] = {}
    for verb, summary in _REQUEST_SUMMARY.items():
        name = f"request.{verb}"
        messages[_camel(verb, "request")] = _message(
            name, f"{verb} request", summary,
            correlation="request_id" if verb in ("place", "quote") else None,
            description="Never published with the retain flag: a retained request is "
                        "answered request.invalid (field `retain`) and not executed. "
                        f"At most {MAX_PAYLOAD // 1024} KiB (larger: request.invalid, "
                        "\"too large\").",
            bindings={"payloadFormatIndicator": 1} | request_props)
    for kind in payloads.EVENTS:
        messages[_camel(kind)] = _message(
            _event_name(kind), f"{kind} event", _EVENT_SUMMARY[kind],
            correlation=None if kind in payloads.OPS_EVENT_TYPES else "correlationid",
            description=f"CloudEvents 1.0, structured mode; `type` "
                        f"`{payloads.event_type(kind)}`. Drop duplicates by `id`; a gap "
                        f"in `seq` within one `bootid` is a missed event.",
            bindings={"payloadFormatIndicator": 1})
    messages["leaseState"] = _message(
        "lease-state", "lease state", "The lease's current state, retained while it is "
        "active.", correlation="request_id",
        description="Republished after every change and after every (re)connect of the "
                    "daemon. It carries no envelope and no `seq`.",
        bindings={"payloadFormatIndicator": 1})
    messages["leaseCleared"] = {
        "name": "lease-cleared", "title": "lease cleared",
        "summary": "An empty retained payload: the lease has ended.",
        "description": "Clears the retained state. The event that ended the lease "
                       "(lease.released, lease.expired, lease.failed) says how.",
    }
    messages["status"] = _message(
        "status", "status", "online or offline, retained.",
        description="`online` at every connect; `offline` at an orderly stop and, as the "
                    "MQTT will, on every other way out (crash, kill, lost connection).",
        bindings={"payloadFormatIndicator": 1})
    messages["capacity"] = _message(
        "capacity", "capacity summary", "One slice of the pool, retained.",
        bindings={"payloadFormatIndicator": 1})

    def mref(message: str) -> dict[str, str]:
        return _ref(f"#/components/messages/{message}")

    params = {
        "scheduler": {"description": "The scheduler id S: `[A-Za-z0-9_.-]{1,64}`, not "
                                     "`_ops`. The caller's identity: an ACL can pin each "
                                     "scheduler's credentials to its own S.",
                      "examples": ["train", "batch-eu"]},
        "type": {"description": "The event kind.", "enum": list(payloads.EVENT_TYPES)},
        "opsType": {"description": "The operations event kind.",
                    "enum": list(payloads.OPS_EVENT_TYPES)},
        "leaseId": {"description": "The lease id.",
                    "examples": ["L-8c1f3e2a9b7d4c6e8f0a1b2c3d4e5f60"]},
        "cloud": {"description": "The cloud.", "enum": list(CLOUDS)},
        "region": {"description": "The cloud's region (`/`, `+`, `#` and control "
                                  "characters replaced by `_`).",
                   "examples": ["us-east-1"]},
        "gpu": {"description": "The GPU model, as in offers.", "examples": ["H100-80GB"]},
        "reply": {"description": "The rest of the ResponseTopic the scheduler chose (one "
                                 "or more topic levels).", "examples": ["r-1"]},
    }

    def channel(address: str, description: str, message_names: Sequence[str]
                ) -> dict[str, Any]:
        c: dict[str, Any] = {"address": f"{P}/{address}", "description": description,
                             "messages": {m: mref(m) for m in message_names}}
        used = re.findall(r"\{(\w+)\}", address)
        if used:
            c["parameters"] = {u: _ref(f"#/components/parameters/{u}") for u in used}
        return c

    channels: dict[str, Any] = {
        "status": channel("status", "The daemon's status, retained; also its MQTT will.",
                          ["status"]),
        **{f"{verb}Requests": channel(
            f"requests/{{scheduler}}/{verb}",
            f"`{verb}` requests of scheduler S. QoS 1, never retained.",
            [_camel(verb, "request")]) for verb in _REQUEST_SUMMARY},
        "events": channel("events/{scheduler}/{type}",
                          "Scheduler S's events, the `<type>` level being the event kind. "
                          "QoS 1, not retained.",
                          [_camel(k) for k in payloads.EVENT_TYPES]),
        "opsEvents": channel("events/_ops/{opsType}",
                             "Operations events (`_ops` is a reserved scheduler id).",
                             [_camel(k) for k in payloads.OPS_EVENT_TYPES]),
        "leases": channel("leases/{scheduler}/{leaseId}",
                          "Each lease's current state, retained while active.",
                          ["leaseState", "leaseCleared"]),
        "capacity": channel("capacity/{cloud}/{region}/{gpu}",
                            "Per cloud, region and GPU model: cheapest prices, free "
                            "capacity, data age. Retained; MQTT 5 message expiry three "
                            "poll intervals.", ["capacity"]),
        "replies": channel("replies/{scheduler}/{reply}",
                           "MQTT 5 only: the answer to a request that carried a "
                           "ResponseTopic under this tree, with its CorrelationData; the "
                           "same bytes as on the events channel.",
                           [_camel(k) for k in payloads.REPLY_EVENT_TYPES]),
    }

    def cref(name: str, *message_names: str) -> dict[str, Any]:
        return {"channel": _ref(f"#/channels/{name}"),
                "messages": [_ref(f"#/channels/{name}/messages/{m}") for m in message_names]}

    def send(name: str, summary: str, *, retain: bool, expiry: dict[str, Any] | None = None
             ) -> dict[str, Any]:
        mqtt: dict[str, Any] = {"qos": 1, "retain": retain}
        if expiry:
            mqtt["messageExpiryInterval"] = expiry
        return {"action": "send", **cref(name, *channels[name]["messages"]),
                "summary": summary, "bindings": {"mqtt": mqtt | _MQTT}}

    operations: dict[str, Any] = {}
    for verb in _REQUEST_SUMMARY:
        operations[_camel("receive", verb, "requests")] = {
            "action": "receive", **cref(f"{verb}Requests", _camel(verb, "request")),
            "summary": f"The daemon takes `{verb}` requests from every scheduler.",
            "bindings": {"mqtt": {"qos": 1} | _MQTT},
            "reply": {"channel": _ref("#/channels/events"),
                      "messages": [_ref(f"#/channels/events/messages/{_camel(k)}")
                                   for k in _ANSWERS[verb]]},
        }
    operations |= {
        "sendStatus": send("status", "online at every connect, offline at an orderly "
                           "stop; the will says offline otherwise.", retain=True),
        "sendEvents": send("events", "Every decision about scheduler S's requests and "
                           "leases.", retain=False),
        "sendOpsEvents": send("opsEvents", "Policy reloads.", retain=False),
        "sendLeaseStates": send("leases", "After every change of a lease and after every "
                                "(re)connect.", retain=True),
        "sendCapacity": send("capacity", "After each poll of a slice and after every "
                             "(re)connect.", retain=True,
                             expiry={"type": "integer", "description":
                                     "3 × poll.interval_seconds (180 s by default)"}),
        "sendReplies": send("replies", "The answer again, to an MQTT 5 ResponseTopic.",
                            retain=False),
    }

    will = {"topic": f"{P}/status", "qos": 1, "retain": True,
            "message": json.dumps(WILL_EXAMPLE, separators=(",", ":"))}
    server_mqtt = {"clientId": "gpubroker-<site> (config mqtt.client_id)",
                   "cleanSession": False, "lastWill": will, "keepAlive": 30,
                   "sessionExpiryInterval": 3600, "maximumPacketSize": MAX_PACKET} | _MQTT
    return {
        "asyncapi": "3.0.0",
        "id": "urn:gpubroker:v1",
        "info": {
            "title": "gpubroker MQTT API",
            "version": __version__,
            "description": (
                "gpubroker brokers GPU capacity across clouds: schedulers send lease "
                "requests, the daemon answers with decisions and keeps each lease's state "
                "retained.\n\nThis document is written from the **daemon's** point of "
                "view: it *receives* requests and *sends* everything else; a scheduler "
                "does the opposite. Addresses use the default topic prefix "
                f"`{P}` (config `mqtt.topic_prefix`). The prose contract, with the rules "
                "this document cannot say (idempotency, epochs, retained requests, "
                "sizes), is [contract.md](contract.md). Generated by `python -m "
                "broker.wire.contract`: do not edit."),
            "license": {"name": "Apache-2.0",
                        "url": "https://www.apache.org/licenses/LICENSE-2.0"},
        },
        "defaultContentType": "application/json",
        "servers": {
            "mqtt": {"host": "{host}:{port}", "protocol": "mqtt", "protocolVersion": "5",
                     "description": "config `mqtt.url` `mqtt://HOST[:PORT]`. MQTT 5 by "
                                    "default (`mqtt.protocol`); 3.1.1 works too, without "
                                    "replies and message expiry.",
                     "variables": {"host": {"default": "127.0.0.1"},
                                   "port": {"default": "1883"}},
                     "bindings": {"mqtt": server_mqtt}},
            "mqtts": {"host": "{host}:{port}", "protocol": "secure-mqtt",
                      "protocolVersion": "5",
                      "description": "`mqtts://HOST[:PORT]`: TLS, with user names and "
                                     "passwords and a per-scheduler ACL as in "
                                     "deploy/mosquitto/.",
                      "variables": {"host": {"examples": ["mqtt.example.internal"]},
                                    "port": {"default": "8883"}},
                      "security": [_ref("#/components/securitySchemes/userPassword")],
                      "bindings": {"mqtt": server_mqtt}},
        },
        "channels": channels,
        "operations": operations,
        "components": {
            "schemas": {"cloudEvent": _payload("event"),
                        "placement": _payload("placement")},
            "messages": messages,
            "parameters": params,
            "securitySchemes": {"userPassword": {
                "type": "userPassword", "description": "A scheduler logs in with its "
                "scheduler id S as user name."}},
        },
    }


# --- OpenAPI --------------------------------------------------------------------------------

HTTP_LISTEN = "127.0.0.1:9464"
"""The default `http.listen`; the OpenAPI document's server."""
_JSON = "application/json"


def _schema_ref(name: str) -> dict[str, str]:
    return _ref(f"#/components/schemas/{name}")


def _content(schema: dict[str, Any]) -> dict[str, Any]:
    return {_JSON: {"schema": schema}}


def _answers(verb: str) -> dict[str, Any]:
    """The schema of the 200 answers to `verb`: one of its answer events but
    `request.invalid` (422)."""
    kinds = [k for k in _ANSWERS[verb] if k != "request.invalid"]
    refs = [_schema_ref(_event_name(k)) for k in kinds]
    return refs[0] if len(refs) == 1 else {"oneOf": refs}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": _content(_schema_ref("error"))}


def openapi() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the HTTP API (docs/contract.md §8): the requests
    (`POST /v1/requests/{scheduler}/<verb>`, the MQTT bodies and answers, the same
    schemas) and the read-only views."""
    P = PREFIX
    token: list[dict[str, list[str]]] = [{"bearer": []}]
    view_token: list[dict[str, list[str]]] = [{}, {"bearer": []}]  # views_need_token
    paths: dict[str, Any] = {}
    for verb, summary in _REQUEST_SUMMARY.items():
        paths[f"/v1/requests/{{scheduler}}/{verb}"] = {"post": {
            "operationId": _camel(verb),
            "tags": ["requests"],
            "summary": summary,
            "description": (
                f"The body of `{P}/requests/{{scheduler}}/{verb}` on MQTT; the answer is "
                f"the event the scheduler also gets on `{P}/events/{{scheduler}}/<type>`, "
                f"the same bytes."),
            "security": token,
            "parameters": [_ref("#/components/parameters/scheduler")],
            "requestBody": {"required": True,
                            "content": _content(_schema_ref(f"request.{verb}"))},
            "responses": {
                "200": {"description": "The answer event.", "content": _content(
                    _answers(verb))},
                "400": _ref("#/components/responses/badScheduler"),
                "401": _ref("#/components/responses/unauthorized"),
                "403": _ref("#/components/responses/noToken"),
                "408": _ref("#/components/responses/slowBody"),
                "413": _ref("#/components/responses/tooLarge"),
                "422": {"description": "`request.invalid`: not executed, with every problem "
                                       "found.",
                        "content": _content(_schema_ref("event.request.invalid"))},
                "503": _ref("#/components/responses/unavailable"),
                "504": _error("No answer within 30 s: send it again (a `place` with the "
                              "same `request_id`)."),
            },
        }}
    view_errors = {"401": _ref("#/components/responses/unauthorized"),
                   "403": _ref("#/components/responses/noToken"),
                   "503": _ref("#/components/responses/unavailable")}

    def view(op: str, summary: str, description: str, ok: dict[str, Any],
             parameters: list[Any] | None = None, **more: Any) -> dict[str, Any]:
        o: dict[str, Any] = {"operationId": op, "tags": ["views"], "summary": summary,
                             "description": description, "security": view_token}
        if parameters:
            o["parameters"] = parameters
        o["responses"] = {"200": {"description": summary, "content": _content(ok)},
                          **more, **view_errors}
        return {"get": o}

    def query(name: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "in": "query", "required": False, "description": description,
                "schema": schema}

    text = {"text/plain": {"schema": {"type": "string"}}}
    paths |= {
        "/livez": {"get": {"operationId": "livez", "tags": ["health"],
                           "summary": "The event loop answers.", "security": [],
                           "responses": {"200": {"description": "`ok`", "content": text}}}},
        "/readyz": {"get": {"operationId": "readyz", "tags": ["health"],
                            "summary": "MQTT connected and a fresh poll in; only the leader.",
                            "security": [],
                            "responses": {
                                "200": {"description": "`ready`", "content": text},
                                "503": {"description": "`not ready: <reasons>` (a standby: "
                                                       "`not ready: standby (…)`)",
                                        "content": text}}}},
        "/metrics": {"get": {"operationId": "metrics", "tags": ["health"],
                             "summary": "Prometheus text format; every metric `gpubroker_…`.",
                             "security": [],
                             "responses": {"200": {"description": "The metrics.",
                                                   "content": text}}}},
        "/v1/offers": view(
            "offers", "The pool, cheapest per GPU-hour first.",
            "A standby does not poll: 503.",
            {"type": "array", "items": _schema_ref("offer")},
            [query("gpu", "Only this GPU model.", {"type": "string"}),
             query("cloud", "Only this cloud.", {"type": "string"}),
             query("region", "Only this region.", {"type": "string"}),
             query("market", "Only this market.",
                   {"enum": ["spot", "on_demand", "reserved"]}),
             query("fresh", "`1` or `true`: only offers fresh enough to place on.",
                   {"type": "string"}),
             query("limit", "At most this many (default 1000).", {"type": "integer"})],
            **{"400": _error("A bad `limit` or `market`.")}),
        "/v1/leases": view(
            "leases", "Leases as committed, oldest first.",
            "The active ones unless `state` says otherwise; ended leases are those within "
            "`state.keep_ended_hours`.",
            {"type": "array", "items": _schema_ref("lease-state")},
            [query("state", "Which leases (default `active`).",
                   {"enum": ["active", "released", "expired", "failed", "all"]}),
             query("scheduler", "Only this scheduler's.", {"type": "string"})],
            **{"400": _error("A bad `state`.")}),
        "/v1/leases/{lease_id}": view(
            "lease", "One lease state, in any state.", "As committed.",
            _schema_ref("lease-state"),
            [{"name": "lease_id", "in": "path", "required": True,
              "description": "The lease id.", "schema": {"type": "string"}}],
            **{"404": _error("No such lease.")}),
        "/v1/policy": view(
            "policy", "The policy in force.", "Its hash, its file and its content.",
            {"type": "object", "required": ["hash", "file", "policy"], "properties": {
                "hash": {"type": ["string", "null"],
                         "description": "`sha256:` and the file's SHA-256."},
                "file": {"type": "string", "description": "The policy file's path."},
                "policy": {"type": "object", "description": "The policy, as loaded."}}}),
    }
    schemas: dict[str, Any] = {p.name: _ref(f"./schemas/{p.name}.schema.json")
                               for p in PAYLOADS if p.name != "event"}
    schemas["error"] = {"type": "object", "required": ["error"],
                        "properties": {"error": {"type": "string",
                                                 "description": "What went wrong."}}}
    return {
        "openapi": "3.1.0",
        "jsonSchemaDialect": DIALECT,
        "info": {
            "title": "gpubroker HTTP API",
            "version": __version__,
            "summary": "Health, metrics, read-only views and the schedulers' requests.",
            "description": (
                "The HTTP side of gpubroker (docs/contract.md §8). A request over HTTP "
                "takes the MQTT request's body and answers with the event the scheduler "
                f"also gets on `{P}/events/{{scheduler}}/<type>`, the same bytes; the "
                "schemas are those of the MQTT API (`./schemas/`, as in asyncapi.yaml). "
                "Errors other than events are `{\"error\": \"…\"}`. Generated by "
                "`python -m broker.wire.contract`: do not edit."),
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "servers": [{"url": f"http://{HTTP_LISTEN}",
                     "description": "config `http.listen` (loopback by default)"}],
        "tags": [{"name": "requests", "description": "A scheduler's requests; a bearer "
                  "token (`http.token_file`) always."},
                 {"name": "views", "description": "Read-only; a bearer token only with "
                  "`http.views_need_token`."},
                 {"name": "health", "description": "Never a token."}],
        "paths": paths,
        "components": {
            "schemas": schemas,
            "parameters": {"scheduler": {
                "name": "scheduler", "in": "path", "required": True,
                "description": "The scheduler id S: `[A-Za-z0-9_.-]{1,64}`, not `_ops` "
                               "(reserved).",
                "schema": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$",
                           "not": {"const": "_ops"}}}},
            "responses": {
                "badScheduler": _error("A scheduler id that does not match "
                                       "`[A-Za-z0-9_.-]{1,64}`, or `_ops` (reserved)."),
                "unauthorized": {
                    "description": "A missing or wrong bearer token.",
                    "headers": {"WWW-Authenticate": {
                        "description": "`Bearer realm=\"gpubroker\"`",
                        "schema": {"type": "string"}}},
                    "content": _content(_schema_ref("error"))},
                "noToken": _error("No `http.token_file` configured (the views: an empty "
                                  "token file)."),
                "slowBody": _error("The body did not arrive within "
                                   "`http.body_timeout_seconds`; the connection closes."),
                "tooLarge": _error(f"A body over {MAX_PAYLOAD // 1024} KiB."),
                "unavailable": _error("The state store failed (not executed); this node is "
                                      "a standby (ask the leader); too many connections."),
            },
            "securitySchemes": {"bearer": {
                "type": "http", "scheme": "bearer",
                "description": "The content of `http.token_file`, compared in constant "
                               "time."}},
        },
    }


# --- files ---------------------------------------------------------------------------------


def render() -> dict[str, str]:
    """Every generated file: path relative to docs/ -> its text."""
    files = {f"schemas/{p.name}.schema.json":
             json.dumps(schema(p.name), indent=2, ensure_ascii=False) + "\n"
             for p in PAYLOADS}
    head = ("# Generated by `python -m broker.wire.contract` from broker/wire/payloads.py: "
            "do not edit.\n")
    files["asyncapi.yaml"] = head + yaml.dump(
        asyncapi(), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)
    files["openapi.yaml"] = head + yaml.dump(
        openapi(), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)
    return files


class _Dumper(yaml.SafeDumper):
    """Writes a shared value out again where it recurs: no `&anchor` / `*alias`, which
    some AsyncAPI tools do not follow."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def differences(docs: Path = DOCS) -> Iterator[str]:
    """One line per generated file that is missing, stale or left over in `docs`."""
    want = render()
    for rel, text in want.items():
        path = docs / rel
        if not path.is_file():
            yield f"{path}: missing"
        elif path.read_text(encoding="utf-8") != text:
            diff = difflib.unified_diff(path.read_text(encoding="utf-8").splitlines(),
                                        text.splitlines(), lineterm="", n=0)
            first = next((d for d in list(diff)[2:] if not d.startswith("@@")), "")
            yield f"{path}: differs (first change: {first[:120]})"
    schemas = docs / "schemas"
    if schemas.is_dir():
        for path in sorted(schemas.glob("*.schema.json")):
            if f"schemas/{path.name}" not in want:
                yield f"{path}: no longer generated"


def write(docs: Path = DOCS) -> list[Path]:
    """Write every generated file under `docs`; remove schemas no longer generated.
    Returns the files written or removed."""
    changed = []
    want = render()
    for rel, text in want.items():
        path = docs / rel
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        changed.append(path)
    for path in sorted((docs / "schemas").glob("*.schema.json")):
        if f"schemas/{path.name}" not in want:
            path.unlink()
            changed.append(path)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m broker.wire.contract", description=(
        "Write docs/schemas/*.schema.json and docs/asyncapi.yaml from broker/wire/payloads.py."))
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if a file differs from what would be written")
    p.add_argument("--docs", type=Path, default=DOCS, help=f"the docs directory ({DOCS})")
    args = p.parse_args(argv)
    if args.check:
        problems = list(differences(args.docs))
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("run: python -m broker.wire.contract", file=sys.stderr)
        return 1 if problems else 0
    for path in write(args.docs):
        print(f"wrote {path}" if path.exists() else f"removed {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
