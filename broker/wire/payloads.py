"""Every payload of the MQTT contract, as types (docs/contract.md §3–§5).

The requests are `broker.wire.validation`' own models: they validate what schedulers send, so
their JSON Schemas say what is accepted. Everything the daemon sends — the CloudEvents
envelope with each event type's `data`, the retained lease state, `P/status`, the
capacity summaries, and the offer of `gpubroker offers` / `GET /v1/offers` — is a
`TypedDict` here, describing the dicts the code builds: a key that may be left out is
`NotRequired`, a value that may be `null` says `| None`. `broker.wire.contract` turns these
types into `docs/schemas/*.schema.json` and `docs/asyncapi.yaml`; the tests validate every
message the daemon sends them against those schemas, so code and contract cannot drift.

Only pydantic and the project's vocabulary are imported: a scheduler's client may use
these types without the daemon's dependencies.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import ConfigDict, Field, with_config
from typing_extensions import TypedDict  # pydantic needs this one on Python < 3.12

from broker.model import CloudName as Clouds
from broker.wire.validation import (
    LeaseRefPayload,
    LookupPayload,
    PlacePayload,
    QuotePayload,
    ReleasePayload,
    ReportPayload,
)

__all__ = [
    "EVENTS",
    "EVENT_TYPES",
    "OPS_EVENT_TYPES",
    "REPLY_EVENT_TYPES",
    "CapacitySummary",
    "CloudEvent",
    "FieldError",
    "LeaseCurrent",
    "LeaseEnded",
    "LeaseFailed",
    "LeaseFailover",
    "LeasePart",
    "LeaseRefPayload",
    "LeaseRenewed",
    "LeaseStateJson",
    "LookupPayload",
    "OfferJson",
    "PlacePayload",
    "PlacementDecided",
    "PlacementJson",
    "PlacementQuoted",
    "PlacementRejected",
    "PolicyApplied",
    "PolicyProblem",
    "PolicyRejected",
    "QuotePart",
    "QuotePayload",
    "ReleasePayload",
    "ReportDeclined",
    "ReportPayload",
    "RequestInvalid",
    "Status",
    "event_type",
]

# What the daemon sends is described exactly: a key the code does not build is an error
# in the tests (broker.wire.contract publishes the schemas open to additions, see there).
_SENT = ConfigDict(extra="forbid")


def _doc(text: str) -> Any:
    """A field's description in the generated schema."""
    return Field(description=text)


Timestamp = Annotated[str, Field(
    pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{3}Z$",
    json_schema_extra={"format": "date-time"},
    description="RFC 3339, UTC, millisecond precision, with a `Z`: "
                "`2026-11-30T12:00:00.123Z`.")]
Uuid = Annotated[str, Field(
    pattern=r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
    json_schema_extra={"format": "uuid"})]
LeaseId = Annotated[str, Field(min_length=1, max_length=128, description=(
    "The lease's id: opaque to schedulers (today `L-` and 32 hex digits)."))]
RequestId = Annotated[str, Field(min_length=1, max_length=128, description=(
    "The scheduler's `request_id` of the placement request: with the scheduler id, the "
    "idempotency key."))]
SchedulerId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description=(
    "The scheduler id `S`, the topic level the request came in on."))]
Price = Annotated[float, Field(ge=0, allow_inf_nan=False)]
# The names of broker.model's enums (tests/wire/test_payloads.py checks they agree).
CloudName = Annotated[Clouds, Field(
    description="`private`: the company's own GPU servers, declared by its ops team.")]
MarketName = Annotated[Literal["spot", "on_demand", "reserved"], Field(
    description="`spot`, `on_demand` or `reserved`: paid-for capacity (a cloud capacity "
                "reservation, or a private server), never interrupted, priced at the margin.")]
RejectCodeName = Literal["no_capacity", "over_price_cap", "over_budget", "policy_denied"]
FailoverReasonName = Literal["interrupted", "capacity_lost", "price_above_cap",
                             "cloud_unhealthy", "reported", "policy_changed", "reoptimized",
                             "maintenance"]
LeaseStateName = Literal["active", "released", "expired", "failed"]
LeaseFailedReason = Literal["interrupted", "capacity_lost", "price_above_cap", "cloud_unhealthy",
                            "reported", "policy_changed", "reoptimized", "maintenance",
                            "ended"]
EndedReason = Annotated[Literal["released", "expired", "interrupted", "capacity_lost",
                                "price_above_cap", "cloud_unhealthy", "reported",
                                "policy_changed", "reoptimized", "maintenance", "ended"],
                        Field(description=(
    "How the lease ended: `released`, `expired`, or the failover reason that failed it "
    "(`ended`: it failed under a daemon before contract 1.1, which kept no reason)."))]
VerbName = Literal["place", "renew", "release", "report", "quote", "lookup"]
Epoch = Annotated[int, Field(ge=1, description=(
    "The lease's fencing token: 1 when decided, one more at each failover. A scheduler "
    "acts only on the highest epoch it has seen for a lease."))]


# --- the shared shapes ------------------------------------------------------------------


@with_config(ConfigDict(extra="forbid", title="Target"))
class TargetJson(TypedDict):
    """What to launch into, on paid-for capacity."""

    id: Annotated[str, Field(min_length=1, max_length=256, description=(
        "A cloud capacity reservation's id (AWS `cr-…`, GCP reservation name, Azure "
        "capacity reservation resource id) or a private server's name."))]
    instances: Annotated[int, Field(ge=1, description="How many instances go into it.")]


@with_config(ConfigDict(extra="forbid", title="Placement"))
class PlacementJson(TypedDict):
    """Where a lease's GPUs are: `instances` instances of one instance type in one pool
    (one zone, one market). `gpus` is GPUs per instance, as in an offer."""

    cloud: Annotated[CloudName, _doc("The cloud.")]
    region: Annotated[str, _doc("The cloud's region name.")]
    zone: Annotated[str, _doc("The cloud's zone name (Azure: `<region>-<n>`).")]
    instance_type: Annotated[str, _doc("The cloud's instance type (VM size) to launch.")]
    market: MarketName
    instances: Annotated[int, Field(ge=1, description="How many instances to launch.")]
    gpu: Annotated[str, _doc(
        "Canonical GPU model (`H100-80GB`), or the cloud's own name for a model outside the "
        "canonical list.")]
    gpus: Annotated[int, Field(ge=1, description="GPUs per instance.")]
    total_gpus: Annotated[int, Field(ge=1, description="`instances` × `gpus`.")]
    price_per_hour: Annotated[Price, _doc(
        "USD per hour for the whole placement (all instances), at decision time.")]
    price_per_gpu_hour: Annotated[Price, _doc("`price_per_hour` / `total_gpus`.")]
    price_observed_at: Annotated[Timestamp, _doc("When the cloud's price was read.")]
    targets: NotRequired[Annotated[list[TargetJson], Field(min_length=1, max_length=1024,
        description=(
            "Market `reserved` only: the reservations or private servers to launch the "
            "instances into, with how many go into each (they add up to `instances`). "
            "Absent on other markets (an addition within v1, §9)."))]]


@with_config(_SENT)
class FieldError(TypedDict):
    """One problem with a request."""

    field: Annotated[str, Field(max_length=200, description=(
        "The field, dotted for nested ones (`labels.team`); `\"\"` for the whole payload "
        "(not JSON, too large ...)."))]
    message: Annotated[str, Field(max_length=500, description="What is wrong, for a person.")]


# --- event data -----------------------------------------------------------------------


PartNumber = Annotated[int, Field(ge=1, le=16, description=(
    "Which part of a split request this lease is: 1 is the head, the lease the "
    "request's idempotency answers with."))]


@with_config(_SENT)
class LeasePart(TypedDict):
    """One part of a request split across pools: a lease of its own (renewed, released
    and failed over by its own `lease_id`), holding `gpus` of the request's GPUs."""

    lease_id: LeaseId
    part: PartNumber
    epoch: Epoch
    gpus: Annotated[int, Field(ge=1, description=(
        "The request's GPUs this part holds (its placement may have more: whole "
        "instances)."))]
    placement: PlacementJson
    expires_at: Timestamp
    state: NotRequired[Annotated[
        Literal["released", "expired", "failed"],
        _doc("Only on a repetition, for a part that has ended since: how it ended.")]]
    ended_reason: NotRequired[EndedReason]
    ended_detail: NotRequired[Annotated[str | None, _doc(
        "With `state`: what happened, for a person (the failover's detail); null for a "
        "release or an expiry.")]]
    ended_at: NotRequired[Annotated[Timestamp, _doc("With `state`: when the lease ended.")]]


@with_config(_SENT)
class PlacementDecided(TypedDict):
    """A lease: the answer to a placement request, and to every repetition of it."""

    request_id: RequestId
    lease_id: LeaseId
    epoch: Epoch
    placement: PlacementJson
    expires_at: Annotated[Timestamp, _doc(
        "When the lease ends unless renewed before (`P/requests/S/renew`).")]
    reason: Annotated[str, _doc(
        "Why this placement, for a person: the solver and its expected cost; "
        "`repeated request: the lease it already has` for a repetition.")]
    alternatives: Annotated[list[PlacementJson], Field(max_length=3, description=(
        "Up to 3 next-best placements, best first; empty for a repetition."))]
    lease_seconds: Annotated[int, Field(ge=1, description=(
        "The lease's time to live: what a renewal adds, from then (contract 1.1)."))]
    state: NotRequired[Annotated[
        Literal["released", "expired", "failed"],
        _doc("Only when the request repeats one whose lease has since ended: how it ended. "
             "Absent while the lease is active.")]]
    ended_reason: NotRequired[EndedReason]
    ended_detail: NotRequired[Annotated[str | None, _doc(
        "With `state`: what happened, for a person (the failover's detail); null for a "
        "release or an expiry.")]]
    ended_at: NotRequired[Annotated[Timestamp, _doc("With `state`: when the lease ended.")]]
    parts: NotRequired[Annotated[list[LeasePart], Field(min_length=2, max_length=16,
                                                        description=(
        "Only for a request split across pools (`gang: false` with `max_parts` above 1): "
        "every part, in order, the first being `lease_id` and `placement` above. Each "
        "part is a lease of its own; together they hold the request's `gpus`."))]]


@with_config(_SENT)
class PlacementRejected(TypedDict):
    """No placement now. A rejected request may be sent again with the same
    `request_id`."""

    request_id: RequestId
    code: Annotated[RejectCodeName, _doc(
        "The constraint that binds: `no_capacity` (pool or quota taken), `over_price_cap`, "
        "`over_budget` (the team's `max_gpus` or `budget_per_hour`), `policy_denied` (a "
        "rule, residency, a list, a spread limit).")]
    detail: Annotated[str, _doc("For a person: what was looked for and what stood in the way.")]
    retry_after_seconds: NotRequired[Annotated[Price, _doc(
        "When capacity may have changed (the next poll); absent when waiting will not "
        "help.")]]


@with_config(_SENT)
class QuotePart(TypedDict):
    """One part of a quoted split: a placement and the request's GPUs it would hold."""

    gpus: Annotated[int, Field(ge=1, description=(
        "The request's GPUs this part would hold (its placement may have more: whole "
        "instances)."))]
    placement: PlacementJson


@with_config(_SENT)
class PlacementQuoted(TypedDict):
    """The answer to a quote: what would be placed now and at what expected cost, or
    why nothing would be. Nothing was placed or held: no lease, no capacity, no
    idempotency record; a `place` sent next may be answered otherwise (the pool moves,
    other requests come first)."""

    request_id: NotRequired[Annotated[RequestId, _doc(
        "The quote's `request_id`, when it sent one (optional; never an idempotency key).")]]
    placement: NotRequired[Annotated[PlacementJson, _doc(
        "Where it would be placed (for a split: the first part). Absent when it would be "
        "rejected.")]]
    expected_cost_per_hour: NotRequired[Annotated[Price, _doc(
        "USD per hour: the expected cost the placement is chosen by (the price with its "
        "interruption, availability and spread terms, §4.1), for all its GPUs (every part "
        "of a split). Absent when it would be rejected.")]]
    expected_cost: NotRequired[Annotated[Price, _doc(
        "USD: `expected_cost_per_hour` × the request's `duration_hours` (1 h when absent). "
        "Absent when it would be rejected.")]]
    reason: NotRequired[Annotated[str, _doc(
        "Why this placement, for a person (as in `placement.decided`). Absent when it "
        "would be rejected.")]]
    alternatives: NotRequired[Annotated[list[PlacementJson], Field(max_length=3, description=(
        "Up to 3 next-best placements, best first. Absent when it would be rejected."))]]
    parts: NotRequired[Annotated[list[QuotePart], Field(min_length=2, max_length=16,
                                                        description=(
        "Only when it would be split across pools (`gang: false` with `max_parts` above "
        "1): every part, in order, the first being `placement` above."))]]
    code: NotRequired[Annotated[RejectCodeName, _doc(
        "Only when it would be rejected: the code `placement.rejected` would carry.")]]
    detail: NotRequired[Annotated[str, _doc(
        "Only when it would be rejected: what was looked for and what stood in the way.")]]
    retry_after_seconds: NotRequired[Annotated[Price, _doc(
        "Only when it would be rejected, as in `placement.rejected`: when capacity may "
        "have changed.")]]


@with_config(_SENT)
class RequestInvalid(TypedDict):
    """A request that was not executed: not JSON, wrong types or values, an unknown
    verb or lease, published with the retain flag, too large."""

    request_id: NotRequired[Annotated[RequestId, _doc(
        "The request's `request_id`, when it had a valid one.")]]
    errors: Annotated[list[FieldError], Field(min_length=1, max_length=20, description=(
        "Every problem found, one per field (at most 20; the last may say how many more)."))]
    topic: Annotated[str, _doc("The topic the request came in on.")]
    verb: NotRequired[Annotated[VerbName, _doc(
        "The verb the topic names, when it is one the daemon knows (contract 1.1).")]]
    lease_id: NotRequired[Annotated[LeaseId, _doc(
        "The request's `lease_id`, when its payload has one that is a string of 1–128 "
        "characters (contract 1.1): the lease the answer is about.")]]


@with_config(_SENT)
class LeaseRenewed(TypedDict):
    """The lease runs on until the new `expires_at`."""

    lease_id: LeaseId
    epoch: Epoch
    expires_at: Annotated[Timestamp, _doc("The new end of the lease.")]


@with_config(_SENT)
class LeaseEnded(TypedDict):
    """The lease has ended (`lease.released`: by the scheduler; `lease.expired`: not
    renewed in time); its instances should be stopped."""

    lease_id: LeaseId


@with_config(_SENT)
class LeaseFailed(TypedDict):
    """A failover found nowhere to go: the lease has ended and its capacity is gone."""

    lease_id: LeaseId
    reason: Annotated[LeaseFailedReason, _doc(
        "The failover reason that ended it, also when a verb on a lease that had already "
        "failed repeats the answer; `ended` only for a lease that failed under a daemon "
        "before contract 1.1 (which kept no reason).")]
    detail: Annotated[str, _doc("For a person: what happened and why nothing else fitted.")]
    ended_at: NotRequired[Annotated[Timestamp, _doc(
        "Only when a verb on a lease that had already failed repeats the answer: when it "
        "failed (contract 1.1).")]]


@with_config(_SENT)
class ReportDeclined(TypedDict):
    """A `report` the anti-flap limits hold back: the lease stays where it is, at its
    epoch (contract 1.1)."""

    lease_id: LeaseId
    epoch: Annotated[Epoch, _doc("The lease's epoch, unchanged.")]
    kind: Annotated[Literal["interrupted", "launch_failed", "unhealthy"], _doc(
        "The report's `kind`.")]
    reason: Annotated[str, _doc("For a person: which limit holds it back.")]
    retry_after_seconds: Annotated[Price, _doc(
        "When the limit no longer holds it back: report again then, if the capacity "
        "still fails.")]


LeaseFailover = TypedDict("LeaseFailover", {
    "lease_id": LeaseId,
    "epoch": Annotated[int, Field(ge=2, description=(
        "The new epoch (the old one + 1): the fencing token of the new placement.")),],
    "from": Annotated[PlacementJson, _doc("The placement the lease leaves.")],
    "to": Annotated[PlacementJson, _doc("The placement the lease moves to.")],
    "reason": Annotated[FailoverReasonName, _doc(
        "What moved it: `interrupted` (a spot interruption notice), `capacity_lost` (the "
        "pool is gone or has no availability), `price_above_cap`, `cloud_unhealthy` (its "
        "region's API kept failing), `reported` (the scheduler's report), `policy_changed`, "
        "`reoptimized` (a placement cheaper by the policy's `reoptimize_min_saving`).")],
    "detail": Annotated[str, _doc("For a person: what happened.")],
})
LeaseFailover.__doc__ = ("The lease moved: launch on `to`, stop what runs on `from`. The "
                         "lease keeps its id, price cap and `expires_at`.")
with_config(_SENT)(LeaseFailover)


@with_config(_SENT)
class PolicyApplied(TypedDict):
    """A policy file was loaded and is in force (`P/events/_ops/policy.applied`)."""

    hash: Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$",
                               description="`sha256:` and the file's SHA-256, hex.")]
    file: Annotated[str, _doc("The policy file's path.")]
    rules: Annotated[int, Field(ge=0, description="How many rules it has.")]
    teams: Annotated[int, Field(ge=0, description="How many teams it names.")]
    leases_to_move: Annotated[int, Field(ge=0, description=(
        "Active leases it forbids, which fail over with reason `policy_changed`."))]


@with_config(_SENT)
class PolicyProblem(TypedDict):
    """One problem of a policy file."""

    line: Annotated[int | None, _doc("1-based line; null when the file could not be read.")]
    column: Annotated[int | None, _doc("1-based column; null with `line`.")]
    key: Annotated[str, _doc("The key path (`teams.research.max_gpus`); `\"\"` for the file.")]
    message: str


@with_config(_SENT)
class PolicyRejected(TypedDict):
    """A policy file was not loaded; the running policy stays
    (`P/events/_ops/policy.rejected`, once per bad content)."""

    file: Annotated[str, _doc("The policy file's path.")]
    errors: Annotated[list[PolicyProblem], Field(min_length=1)]


# --- the envelope ---------------------------------------------------------------------

Source = Annotated[str, Field(pattern=r"^gpubroker://[A-Za-z0-9_.-]{1,64}$", description=(
    "`gpubroker://<site>` (config `site`): which broker sent it."))]
Seq = Annotated[int, Field(ge=1, description=(
    "One more for each event built within a boot (`bootid`), from 1, over every "
    "scheduler: for ordering within a boot only (a scheduler sees only its own topics; "
    "`schedseq` is the one to detect a gap by). Retained lease states are not counted."))]
SchedSeq = Annotated[int, Field(ge=1, description=(
    "CloudEvents extension attribute: one more for each event on this scheduler's "
    "`P/events/S/...`, from 1, across restarts and leaders (kept in the state store with "
    "the event): a gap means a missed event. The same when the event is sent again. "
    "Absent from `_ops` events and from events of daemons before contract 1.1."))]
BootId = Annotated[Uuid, _doc("New at each start of the daemon; `seq` counts within it.")]
EventId = Annotated[Uuid, _doc(
    "Unique per event and the same when the event is sent again (after a reconnect or "
    "a restart): drop duplicates by `id`.")]
Correlation = Annotated[RequestId, _doc(
    "The `request_id` the event concerns: of the request answered, or of the lease's "
    "placement request.")]
LeaseSubject = Annotated[str, Field(pattern=r"^lease/.+$", description="`lease/<lease_id>`.")]
LeaderEpoch = Annotated[int, Field(ge=0, description=(
    "CloudEvents extension attribute: the fencing epoch of the leader that built the event "
    "(the `epoch` of its `P/status`; 0: a single daemon on SQLite). Once a higher one was "
    "seen on an event, drop events with a lower one: they come from a deposed leader, "
    "late. Absent from events of daemons before contract 1.1 (read it as 0)."))]


@with_config(_SENT)
class _Envelope(TypedDict):
    """The CloudEvents 1.0 attributes every event has."""

    specversion: Literal["1.0"]
    id: EventId
    source: Source
    time: Annotated[Timestamp, _doc("When the event happened.")]
    datacontenttype: Literal["application/json"]
    seq: Seq
    bootid: BootId
    leaderepoch: NotRequired[LeaderEpoch]
    schedseq: NotRequired[SchedSeq]


@with_config(_SENT)
class CloudEvent(_Envelope):
    """A CloudEvents 1.0 event in structured mode: every message on `P/events/...` and
    `P/replies/...`. Each event type's schema narrows `type`, `subject`,
    `correlationid` and `data`."""

    type: Annotated[str, Field(pattern=r"^gpubroker\.[a-z_]+\.[a-z_]+\.v1$", description=(
        "`gpubroker.<kind>.v1`; the kind is the event topic's last level."))]
    subject: Annotated[str, _doc(
        "`lease/<lease_id>`, `request/<request_id>` (`request` without one) or `policy`.")]
    correlationid: NotRequired[Annotated[RequestId, _doc(
        "The `request_id` the event concerns. Absent for `_ops` events and for an invalid "
        "request without a valid `request_id`.")]]
    data: dict[str, Any]


@with_config(_SENT)
class PlacementDecidedEvent(_Envelope):
    """`P/events/S/placement.decided`."""

    type: Literal["gpubroker.placement.decided.v1"]
    subject: LeaseSubject
    correlationid: Correlation
    data: PlacementDecided


@with_config(_SENT)
class PlacementRejectedEvent(_Envelope):
    """`P/events/S/placement.rejected`."""

    type: Literal["gpubroker.placement.rejected.v1"]
    subject: Annotated[str, Field(pattern=r"^request/.+$", description=(
        "`request/<request_id>`."))]
    correlationid: Correlation
    data: PlacementRejected


@with_config(_SENT)
class PlacementQuotedEvent(_Envelope):
    """`P/events/S/placement.quoted`."""

    type: Literal["gpubroker.placement.quoted.v1"]
    subject: Annotated[str, Field(pattern=r"^request(/.+)?$", description=(
        "`request/<request_id>`, or `request` when the quote sent none."))]
    correlationid: NotRequired[Annotated[RequestId, _doc(
        "The quote's `request_id`, when it sent one.")]]
    data: PlacementQuoted


@with_config(_SENT)
class RequestInvalidEvent(_Envelope):
    """`P/events/S/request.invalid`."""

    type: Literal["gpubroker.request.invalid.v1"]
    subject: Annotated[str, Field(pattern=r"^request(/.+)?$", description=(
        "`request/<request_id>`, or `request` when it had no valid `request_id`."))]
    correlationid: NotRequired[Annotated[RequestId, _doc(
        "The request's `request_id`, when it had a valid one.")]]
    data: RequestInvalid


@with_config(_SENT)
class LeaseRenewedEvent(_Envelope):
    """`P/events/S/lease.renewed`."""

    type: Literal["gpubroker.lease.renewed.v1"]
    subject: LeaseSubject
    correlationid: Correlation
    data: LeaseRenewed


@with_config(_SENT)
class LeaseReleasedEvent(_Envelope):
    """`P/events/S/lease.released`."""

    type: Literal["gpubroker.lease.released.v1"]
    subject: LeaseSubject
    correlationid: Correlation
    data: LeaseEnded


@with_config(_SENT)
class LeaseExpiredEvent(_Envelope):
    """`P/events/S/lease.expired`."""

    type: Literal["gpubroker.lease.expired.v1"]
    subject: LeaseSubject
    correlationid: Correlation
    data: LeaseEnded


@with_config(_SENT)
class LeaseFailoverEvent(_Envelope):
    """`P/events/S/lease.failover`."""

    type: Literal["gpubroker.lease.failover.v1"]
    subject: LeaseSubject
    correlationid: Correlation
    data: LeaseFailover


@with_config(_SENT)
class LeaseFailedEvent(_Envelope):
    """`P/events/S/lease.failed`."""

    type: Literal["gpubroker.lease.failed.v1"]
    subject: LeaseSubject
    correlationid: Correlation
    data: LeaseFailed


@with_config(_SENT)
class LeaseCurrentEvent(_Envelope):
    """`P/events/S/lease.current`."""

    type: Literal["gpubroker.lease.current.v1"]
    subject: LeaseSubject
    correlationid: Correlation
    data: LeaseCurrent


@with_config(_SENT)
class ReportDeclinedEvent(_Envelope):
    """`P/events/S/report.declined`."""

    type: Literal["gpubroker.report.declined.v1"]
    subject: LeaseSubject
    correlationid: Correlation
    data: ReportDeclined


@with_config(_SENT)
class PolicyAppliedEvent(_Envelope):
    """`P/events/_ops/policy.applied`."""

    type: Literal["gpubroker.policy.applied.v1"]
    subject: Literal["policy"]
    data: PolicyApplied


@with_config(_SENT)
class PolicyRejectedEvent(_Envelope):
    """`P/events/_ops/policy.rejected`."""

    type: Literal["gpubroker.policy.rejected.v1"]
    subject: Literal["policy"]
    data: PolicyRejected


EVENTS: dict[str, Any] = {
    "placement.decided": PlacementDecidedEvent,
    "placement.rejected": PlacementRejectedEvent,
    "placement.quoted": PlacementQuotedEvent,
    "request.invalid": RequestInvalidEvent,
    "lease.renewed": LeaseRenewedEvent,
    "lease.released": LeaseReleasedEvent,
    "lease.expired": LeaseExpiredEvent,
    "lease.failover": LeaseFailoverEvent,
    "lease.failed": LeaseFailedEvent,
    "lease.current": LeaseCurrentEvent,
    "report.declined": ReportDeclinedEvent,
    "policy.applied": PolicyAppliedEvent,
    "policy.rejected": PolicyRejectedEvent,
}
"""Each event kind (the `<type>` topic level) and the type of its whole message."""
OPS_EVENT_TYPES = ("policy.applied", "policy.rejected")
"""The kinds published on `P/events/_ops/<type>`; the others go to `P/events/S/<type>`."""
EVENT_TYPES = tuple(k for k in EVENTS if k not in OPS_EVENT_TYPES)
REPLY_EVENT_TYPES = ("placement.decided", "placement.rejected", "placement.quoted",
                     "request.invalid", "lease.renewed", "lease.released", "lease.expired",
                     "lease.failed", "lease.failover", "lease.current", "report.declined")
"""The kinds that answer a request, and so also go to its MQTT 5 ResponseTopic."""


def event_type(kind: str) -> str:
    """The CloudEvents `type` of an event kind: `gpubroker.<kind>.v1`."""
    return f"gpubroker.{kind}.v1"


# --- retained state, status, capacity, offers ----------------------------------------------


@with_config(ConfigDict(extra="forbid", title="LeaseState"))
class LeaseStateJson(TypedDict):
    """A lease as the daemon holds it: the retained `P/leases/S/<lease_id>` (always
    `active` there; the topic is cleared with an empty retained payload when the lease
    ends) and `GET /v1/leases`, `GET /v1/leases/{id}` (any state)."""

    lease_id: LeaseId
    scheduler: SchedulerId
    request_id: RequestId
    state: Annotated[LeaseStateName, _doc(
        "`active`, or how it ended: `released`, `expired`, `failed`.")]
    epoch: Epoch
    placement: PlacementJson
    created_at: Timestamp
    expires_at: Annotated[Timestamp, _doc("When it ends unless renewed.")]
    updated_at: Annotated[Timestamp, _doc("The last change: decided, renewed, moved, ended.")]
    lease_seconds: Annotated[int, Field(ge=1, description="What a renewal adds, from now.")]
    max_price_per_gpu_hour: Annotated[Price | None, _doc(
        "The price cap the lease was decided under (the request's, the policy's or a "
        "rule's, the lowest); failovers keep it. null: none.")]
    part: NotRequired[PartNumber]
    parts: NotRequired[Annotated[list[LeaseId], Field(min_length=2, max_length=16,
                                                       description=(
        "Only for a part of a split request: the lease ids of all its parts, in order."))]]
    ended_reason: NotRequired[EndedReason]
    ended_detail: NotRequired[Annotated[str | None, _doc(
        "Only once ended: what happened, for a person (the failover's detail); null for "
        "a release or an expiry.")]]
    ended_at: NotRequired[Annotated[Timestamp, _doc("Only once ended: when it ended.")]]


@with_config(ConfigDict(extra="forbid", title="LeaseCurrent"))
class LeaseCurrent(LeaseStateJson):
    """The answer to a `renew`, `release` or `report` that sent an older `epoch` than the
    lease's: nothing was done; this is the lease as it is now (as on
    `P/leases/S/<lease_id>`), like a Kubernetes 409 Conflict that carries the current
    object (contract 1.1)."""

    stale_epoch: Annotated[Epoch, _doc("The epoch the request sent.")]


@with_config(_SENT)
class Status(TypedDict):
    """The retained `P/status`: `online` at every connect, `offline` at an orderly stop
    and as the MQTT will (a crash, a kill, a lost connection)."""

    state: Literal["online", "offline"]
    ts: Annotated[Timestamp, _doc("When this status was published (or, for the will, "
                                  "when the connection that left it was made).")]
    boot_id: Annotated[Uuid, _doc("The daemon start it describes: the `bootid` of its events.")]
    version: Annotated[str, _doc("The daemon's version (`gpubroker --version`).")]
    node: Annotated[str, _doc("The node that publishes it (config `node`, default the host "
                              "name); with high availability, the site's leader.")]
    role: Annotated[Literal["leader", "standby"], _doc(
        "Always `leader`: only the node that leads the site publishes `P/status`.")]
    epoch: Annotated[int, Field(ge=0, description=(
        "The leader's fencing epoch (high availability; it rises at each takeover). 0: a "
        "single daemon on SQLite."))]


@with_config(_SENT)
class CapacitySummary(TypedDict):
    """The retained `P/capacity/<cloud>/<region>/<gpu>`: one slice of the pool, after each
    poll of its region (MQTT 5 message expiry: three poll intervals)."""

    cloud: Annotated[CloudName, _doc("The cloud.")]
    region: str
    gpu: str
    cheapest_spot_per_gpu_hour: Annotated[Price | None, _doc(
        "USD per GPU-hour of the cheapest priced spot offer; null: none.")]
    cheapest_on_demand_per_gpu_hour: Annotated[Price | None, _doc(
        "USD per GPU-hour of the cheapest priced on-demand offer (paid-for capacity not "
        "included); null: none.")]
    cheapest_reserved_per_gpu_hour: Annotated[Price | None, _doc(
        "USD per GPU-hour, at the margin, of the cheapest offer on paid-for capacity "
        "(market `reserved`: cloud capacity reservations, private servers; 0 when paid "
        "for whatever happens); null: none.")]
    free_instances: Annotated[int | None, _doc(
        "Free instances summed over the slice's offers that have an estimate (the "
        "cloud's estimate less what the broker's leases hold), every market; null: no "
        "estimate.")]
    free_gpus: Annotated[int | None, _doc("The same in GPUs.")]
    reserved_gpus: Annotated[int, Field(ge=0, description=(
        "Paid-for GPUs in the slice (market `reserved`), free or not; 0: none."))]
    free_reserved_instances: Annotated[int | None, _doc(
        "The part of `free_instances` on paid-for capacity; null: no estimate (or no "
        "paid-for capacity).")]
    free_reserved_gpus: Annotated[int | None, _doc("The same in GPUs.")]
    pools: Annotated[int, Field(ge=1, description="Offers (pools) in the slice.")]
    observed_at: Annotated[Timestamp, _doc("The oldest `observed_at` of the slice's offers.")]
    age_seconds: Annotated[float | None, _doc(
        "Age of the slice's data when summarised; null before its first poll.")]


@with_config(ConfigDict(extra="forbid", title="Offer"))
class OfferJson(TypedDict):
    """One offer: a line of `gpubroker offers --format json`, an item of
    `GET /v1/offers`. Unknown values are null."""

    cloud: Annotated[CloudName, _doc("The cloud.")]
    region: str
    zone: str
    instance_type: str
    market: MarketName
    gpu: Annotated[str, _doc("Canonical model, or the cloud's name for one outside the list.")]
    gpus: Annotated[int, _doc("GPUs per instance.")]
    gpu_memory_gb: float | None
    vcpus: int | None
    memory_gb: float | None
    price_per_hour: Annotated[Price | None, _doc("USD per instance-hour; null: no price.")]
    price_per_gpu_hour: Price | None
    observed_at: Annotated[Timestamp, _doc("When the price and signals were read.")]
    availability: Annotated[Annotated[float, Field(ge=0, le=1)] | None, _doc(
        "0..1 from the cloud's capacity signal.")]
    capacity: Annotated[int | None, _doc("Estimated free instances.")]
    interruption_rate: Annotated[float | None, _doc("Interruptions per hour (spot).")]
    quota_headroom: Annotated[int | None, _doc("GPUs the quota still allows.")]
    owned_gpus: NotRequired[Annotated[int, Field(ge=0, description=(
        "Market `reserved` only: the pool's paid-for GPUs (its reservations' or servers' "
        "that are up), free or not; `capacity` is what is free of them."))]]
    rate_observed_at: NotRequired[Annotated[Timestamp, _doc(
        "When the source of `interruption_rate` was published or observed, where the cloud "
        "says (AWS: the Spot Instance Advisor document's Last-Modified); `observed_at` is "
        "when it was read. Absent when the cloud does not say.")]]
