"""Validation of what schedulers send (SPEC §3, §4).

Anything a scheduler sends is untrusted: bad JSON, wrong types and out-of-range values
come back as a list of `{"field", "message"}` errors, never as an exception that could
reach the daemon's loops. Unknown fields are ignored.

The decoder is total: every payload, whatever its bytes, gives a value or an `Invalid`.
Before `json` sees a payload it is checked for size (`MAX_PAYLOAD`), strict UTF-8 and
nesting depth (`MAX_DEPTH`, so the recursive decoder cannot run out of stack). Numbers
may have at most `MAX_DIGITS` digits in a row (CPython refuses to convert an integer of
more than 4,300 digits, with an exception); `NaN` and `Infinity` are not JSON (a number
too large for a float, such as `1e400`, is refused by the fields that take numbers).
Decoded text must be valid Unicode: a lone surrogate escape such as `"\\ud800"` decodes
to a Python string that cannot be encoded again, in an event or in SQLite.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationError,
    WithJsonSchema,
)

from adapters import gpus
from broker.model import GPU_MODELS, PlaceRequest
from policies.checks import did_you_mean, suggestions

FieldError = dict[str, str]

_Name = Annotated[StrictStr, Field(min_length=1, max_length=64)]

MAX_PARTS = 16
"""Most leases one request may be split into (`max_parts`)."""


def _null_is(default: Any) -> BeforeValidator:
    """`null` for an optional field means its default (docs/contract.md §4.1), also for
    the fields whose default is a value rather than `null`."""
    return BeforeValidator(lambda v: default if v is None else v)


_OrNull = {"type": "null"}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, use_attribute_docstrings=True)


class PlacePayload(_Lenient):
    """A placement request (`P/requests/S/place`, `POST /v1/requests/{S}/place`). Fields
    not listed are ignored."""

    request_id: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    """The idempotency key: the same scheduler and `request_id` always get the same
    lease, never a second one."""
    gpu: _Name | Annotated[list[_Name], Field(min_length=1, max_length=16)]
    """A GPU model (`H100-80GB`) or a list of acceptable ones."""
    gpus: Annotated[int, Field(ge=1, le=4096)]
    """GPUs wanted in all."""
    gang: Annotated[StrictBool, _null_is(True), WithJsonSchema(
        {"anyOf": [{"type": "boolean"}, _OrNull]})] = True
    """All instances in one pool (one zone). `false` alone changes nothing; with
    `max_parts` above 1 it lets the request be split across pools."""
    market: Literal["spot", "on_demand", "reserved", "any"] | None = None
    """Default: the policy's `defaults.market`."""
    max_price_per_gpu_hour: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    """USD per GPU-hour, at most."""
    clouds: Annotated[list[_Name], Field(min_length=1, max_length=16)] | None = None
    """Only these clouds."""
    regions: Annotated[list[_Name], Field(min_length=1, max_length=256)] | None = None
    """Only these regions."""
    team: _Name | None = None
    """The team whose policy limits and budget apply."""
    duration_hours: Annotated[float, Field(gt=0, le=24 * 366,
                                           allow_inf_nan=False)] | None = None
    """Expected run time; weighs the placement's expected cost (1 h when absent)."""
    lease_seconds: Annotated[int, Field(ge=1, le=7 * 86400)] | None = None
    """The lease's renewable time to live. Default: the policy's `defaults.lease_seconds`."""
    labels: Annotated[dict[_Name, Annotated[StrictStr, Field(max_length=256)]],
                      Field(max_length=64)] | None = None
    """Free-form; policy rules may match on them."""
    max_parts: Annotated[int, Field(ge=1, le=MAX_PARTS), _null_is(1), WithJsonSchema(
        {"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_PARTS}, _OrNull]})] = 1
    """With `gang: false`: the request may be split into up to this many leases, one per
    pool, when no one pool can hold it or the split is cheaper. A scheduler that sends it
    reads the decision's `parts`. Default 1: one lease, one pool."""


class QuotePayload(PlacePayload):
    """A quote (`P/requests/S/quote`, `POST /v1/requests/{S}/quote`): a placement request's
    body, `request_id` optional. Nothing is placed or held. Fields not listed are ignored."""

    request_id: Annotated[StrictStr, Field(min_length=1, max_length=128)] | None = None  # type: ignore[assignment]
    """Optional: echoed in the answer (`placement.quoted`), never an idempotency key."""


_LeaseId = Annotated[StrictStr, Field(min_length=1, max_length=128)]
_RequestId = Annotated[StrictStr, Field(min_length=1, max_length=128)]
_Epoch = Annotated[int, Field(ge=1)]


class LeaseRefPayload(_Lenient):
    """`P/requests/S/renew`. Fields not listed are ignored."""

    lease_id: _LeaseId
    """A lease of this scheduler."""
    epoch: _Epoch | None = None
    """The lease's epoch as the scheduler knows it. Older than the lease's: nothing
    changes, answered `lease.current` (the lease as it is now); newer: `request.invalid`.
    Absent: the lease's current epoch, whatever it is (contract 1.0)."""


def _one_of_lease_or_request(schema: dict[str, Any]) -> None:
    schema["oneOf"] = [
        {"required": ["lease_id"], "properties": {"lease_id": {"type": "string"}}},
        {"required": ["request_id"], "properties": {"request_id": {"type": "string"},
                                                    "epoch": {"type": "null"}}}]


class ReleasePayload(_Lenient):
    """`P/requests/S/release`: exactly one of `lease_id` (that lease) and `request_id`
    (the lease placed with it, every part of a split). Fields not listed are ignored."""

    model_config = ConfigDict(json_schema_extra=_one_of_lease_or_request)

    lease_id: _LeaseId | None = None
    """A lease of this scheduler."""
    request_id: _RequestId | None = None
    """The `request_id` a lease of this scheduler was placed with: releases that lease,
    every part of it if it was split. Unknown (not placed, or not decided yet):
    `request.invalid`."""
    epoch: _Epoch | None = None
    """With `lease_id` only, as in `renew`: an older epoch releases nothing (answered
    `lease.current`)."""


class LookupPayload(_Lenient):
    """`P/requests/S/lookup`: the lease placed with `request_id`, as it is now (answered
    `placement.decided`, like a repeated `place`); nothing is placed. Fields not listed
    are ignored."""

    request_id: _RequestId
    """The `request_id` of a `place` of this scheduler."""


class ReportPayload(LeaseRefPayload):
    """`P/requests/S/report`: the scheduler saw the lease's capacity fail. The lease fails
    over (reason `reported`) and the pool cools down. Fields not listed are ignored."""

    kind: Literal["interrupted", "launch_failed", "unhealthy"]
    """What the scheduler saw."""
    detail: Annotated[StrictStr, Field(max_length=1024)] | None = None
    """For a person (a cloud's error code such as `ZONE_RESOURCE_POOL_EXHAUSTED` helps)."""


@dataclass(frozen=True, slots=True)
class Invalid:
    errors: list[FieldError]
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class Quote:
    """A valid quote: the request it prices (its `request_id` "" when none was sent) and
    the `request_id` sent, if any."""

    request: PlaceRequest
    request_id: str | None


@dataclass(frozen=True, slots=True)
class LeaseRef:
    """A lease verb's lease: by `lease_id` (with the `epoch` sent, if any), or, for a
    `release`, by `request_id` (`lease_id` then "")."""

    lease_id: str
    epoch: int | None = None
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class Report:
    lease_id: str
    kind: str
    detail: str | None
    epoch: int | None = None


MAX_PAYLOAD = 64 * 1024
"""Largest request accepted, in bytes (SPEC §3); larger ones are answered "too large"."""
MAX_PACKET = 128 * 1024
"""The MQTT 5 Maximum Packet Size announced on connect: the server never forwards the
daemon a larger message (SPEC §3), so one huge publish can neither wedge the session nor
fill the daemon's memory."""
MAX_DEPTH = 32
"""Deepest nesting of arrays and objects accepted (a valid request needs 2)."""
MAX_DIGITS = 64
"""Most digits in a row a number may have."""


class _Refused(ValueError):
    """A JSON value the decoder does not accept (raised by its hooks)."""


class _Bad:
    """A refused value, left in place by the careful decoder to name its field."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


_RUNS = re.compile(r"[0-9]+")


def _digits(literal: str) -> None:
    run = max(map(len, _RUNS.findall(literal)), default=0)
    if run > MAX_DIGITS:
        raise _Refused(f"a number with {run} digits in a row (at most {MAX_DIGITS})")


def _int(literal: str) -> int:
    if len(literal) > MAX_DIGITS:
        _digits(literal)
    return int(literal)


def _float(literal: str) -> float:
    if len(literal) > MAX_DIGITS:
        _digits(literal)
    return float(literal)


def _constant(literal: str) -> float:
    raise _Refused(f"{literal} is not a JSON number")


# Numbers converted by `json`'s C code: the common case, when the payload has no run of
# more than MAX_DIGITS digits anywhere (then no number is too long for `int`, which
# refuses more than 4,300 digits with an exception). `NaN` and `Infinity` are refused.
_PLAIN = json.JSONDecoder(parse_constant=_constant)
_DIGIT_RUN = b"0" * (MAX_DIGITS + 1)
_DIGITS_ONLY = bytes(48 if 48 <= c <= 57 else 32 for c in range(256))  # digit -> "0"


def _careful(text: str) -> tuple[Any, bool]:
    """Every number checked by a hook; a refused one is left in place as `_Bad` (no
    exception ends the decoding), so that the error can name where it is. Returns the
    value and whether something was refused."""
    refused: list[_Bad] = []

    def marking(hook: Any) -> Any:
        def mark(literal: str) -> Any:
            try:
                return hook(literal)
            except _Refused as exc:
                refused.append(bad := _Bad(str(exc)))
                return bad
        return mark

    decoder = json.JSONDecoder(parse_int=marking(_int), parse_float=marking(_float),
                               parse_constant=marking(_constant))
    return decoder.decode(text), bool(refused)


_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'"[]{}')
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_TOO_MANY_OPEN = b"[" * (MAX_DEPTH + 1)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _too_deep(payload: bytes) -> str | None:
    """Why the payload's arrays and objects cannot be decoded safely: nested deeper than
    `MAX_DEPTH`, or not matched. No recursion; C-speed passes over bytes."""
    if payload.count(b"[") + payload.count(b"{") <= MAX_DEPTH:
        return None  # cannot be deeper than that: the common case
    # The brackets outside string literals. Drop the escapes that could hide a string's
    # end (`\\`, then `\"`) and keep only quotes and brackets (`{` as `[`, `}` as `]`:
    # depth does not depend on which; `json` reports a mismatch before it goes deeper).
    # Two quotes side by side enclose no bracket, whether they open and close a string
    # or close one and open the next; then what lies between a quote and the next is in
    # a string.
    if b"\\" in payload:
        payload = payload.replace(b"\\\\", b"").replace(b'\\"', b"")
    skeleton = payload.translate(_BRACKETS, _NOT_STRUCTURE).replace(b'""', b"")
    if b'"' in skeleton:
        skeleton = b"".join(skeleton.split(b'"')[::2])
    # Remove the innermost pairs, one level a pass (`replace` does not look again at
    # what it joined); more than MAX_DEPTH openers in a row is too deep at once.
    for _ in range(MAX_DEPTH):
        if not skeleton:
            return None
        if _TOO_MANY_OPEN in skeleton:
            break
        shorter = skeleton.replace(b"[]", b"")
        if len(shorter) == len(skeleton):
            return "not valid JSON: brackets do not match"
        skeleton = shorter
    return None if not skeleton else f"nested deeper than {MAX_DEPTH} levels"


def _first_bad(data: Any) -> FieldError | None:
    """The first refused value or lone surrogate in the decoded value. An iterative walk
    (the depth check bounds the nesting, the size check the number of nodes); an entry
    is (value, key, parent entry), the path is built only for what is found."""
    stack: list[tuple[Any, Any, Any]] = [(data, None, None)]
    pop, push = stack.pop, stack.append
    while stack:
        entry = value, _, _ = pop()
        kind = type(value)
        if kind is str:
            if not value.isascii() and (m := _SURROGATE.search(value)) is not None:
                return {"field": _path(entry), "message":
                        f"contains a lone surrogate (U+{ord(m.group()):04X}): "
                        "not valid Unicode"}
        elif kind is dict:
            for key, item in value.items():
                if not key.isascii() and (m := _SURROGATE.search(key)) is not None:
                    return {"field": _path(entry), "message":
                            f"has a key with a lone surrogate (U+{ord(m.group()):04X}): "
                            "not valid Unicode"}
                push((item, key, entry))
        elif kind is list:
            stack.extend(zip(value, range(len(value)), repeat(entry)))
        elif kind is _Bad:
            return {"field": _path(entry), "message": f"not accepted: {value.why}"}
    return None


def _path(entry: tuple[Any, Any, Any]) -> str:
    parts: list[str] = []
    while entry[2] is not None:
        key = str(entry[1])
        parts.append(key if len(key) <= 64 else key[:64] + "...")
        entry = entry[2]
    return ".".join(reversed(parts))


def _rid(data: Any) -> str | None:
    """The request_id to echo in an answer: only a valid one."""
    rid = data.get("request_id") if isinstance(data, dict) else None
    if isinstance(rid, str) and 0 < len(rid) <= 128 and _SURROGATE.search(rid) is None:
        return rid
    return None


def _not_json(message: str) -> Invalid:
    return Invalid([{"field": "", "message": message}])


def _decode(payload: bytes) -> dict[str, Any] | Invalid:
    """The payload as a JSON object, or why not; never raises."""
    if len(payload) > MAX_PAYLOAD:
        return _not_json(f"too large: {len(payload)} bytes (at most {MAX_PAYLOAD})")
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        return _not_json(f"not valid JSON: not UTF-8 ({exc.reason} at byte {exc.start})")
    if text.startswith("\ufeff"):
        return _not_json("not valid JSON: starts with a byte order mark")
    deep = _too_deep(payload)
    if deep is not None:
        return _not_json(deep)
    careful = _DIGIT_RUN in payload.translate(_DIGITS_ONLY)
    try:
        if careful:
            data, careful = _careful(text)
        else:
            try:
                data = _PLAIN.decode(text)
            except _Refused:  # NaN or Infinity: again, to name its field
                data, careful = _careful(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        return _not_json(f"not valid JSON: {exc}")
    # Only a `\uD800`-`\uDFFF` escape can make a surrogate (strict UTF-8 has none).
    if careful or (b"\\" in payload and _SURROGATE_ESCAPE.search(payload) is not None):
        bad = _first_bad(data)
        if bad is not None:
            return Invalid([bad], _rid(data))
    if not isinstance(data, dict):
        return _not_json("expected a JSON object")
    return data


_HINTS = {"gpu": "must be a GPU model name or a non-empty list of up to 16 names"}


def _errors(err: ValidationError) -> list[FieldError]:
    out: list[FieldError] = []
    for e in err.errors(include_url=False):
        loc = [str(p) for p in e["loc"] if not str(p).startswith(("function-", "list["))]
        # pydantic names union members (`str`, `list[...]`) in the loc; drop those.
        loc = [p for p in loc if p not in ("str", "constrained-str")]
        msg = "required" if e["type"] == "missing" else _HINTS.get(loc[0] if loc else "", e["msg"])
        out.append({"field": ".".join(loc), "message": msg})
    # One message per field is enough for a person; keep the first.
    seen: dict[str, FieldError] = {}
    for fe in out:
        seen.setdefault(fe["field"], fe)
    return list(seen.values())


_Model = TypeVar("_Model", bound=BaseModel)
_Body = TypeVar("_Body", PlacePayload, QuotePayload)


def _validated(model: type[_Model], payload: bytes, *, echo_rid: bool = True
               ) -> _Model | Invalid:
    """A request body, decoded and validated by its model; else what is wrong with it
    (with the body's valid `request_id` when `echo_rid`)."""
    data = _decode(payload)
    if isinstance(data, Invalid):
        return data
    try:
        return model.model_validate(data)
    except ValidationError as err:
        return Invalid(_errors(err), _rid(data) if echo_rid else None)


def _place_body(model: type[_Body], payload: bytes) -> _Body | Invalid:
    """A `place` or `quote` body, decoded, validated and checked for a split."""
    p = _validated(model, payload)
    return p if isinstance(p, Invalid) else (_split_needs_no_gang(p) or p)


def parse_place(scheduler: str, payload: bytes) -> PlaceRequest | Invalid:
    p = _place_body(PlacePayload, payload)
    return p if isinstance(p, Invalid) else _request(scheduler, p, p.request_id)


def parse_quote(scheduler: str, payload: bytes) -> Quote | Invalid:
    """A quote's body: `parse_place`'s rules, `request_id` optional."""
    p = _place_body(QuotePayload, payload)
    if isinstance(p, Invalid):
        return p
    return Quote(_request(scheduler, p, p.request_id or ""), p.request_id)


def _split_needs_no_gang(p: PlacePayload) -> Invalid | None:
    if p.max_parts > 1 and p.gang:
        return Invalid([{"field": "max_parts",
                         "message": "above 1 needs gang: false (a gang is one pool)"}],
                       p.request_id)
    return None


def _request(scheduler: str, p: PlacePayload, request_id: str) -> PlaceRequest:
    return PlaceRequest(
        scheduler=scheduler,
        request_id=request_id,
        gpu=(p.gpu,) if isinstance(p.gpu, str) else tuple(dict.fromkeys(p.gpu)),
        gpus=p.gpus,
        gang=p.gang,
        market=p.market,
        max_price_per_gpu_hour=p.max_price_per_gpu_hour,
        clouds=tuple(p.clouds) if p.clouds else None,
        regions=tuple(p.regions) if p.regions else None,
        team=p.team,
        duration_hours=p.duration_hours,
        lease_seconds=p.lease_seconds,
        labels=dict(p.labels or {}),
        max_parts=p.max_parts,
    )


def unknown_gpus(req: PlaceRequest, known: Callable[[], Collection[str]]
                 ) -> Invalid | None:
    """`request.invalid` (field `gpu`, with the nearest names) for the GPU models of `req`
    that nobody knows, else None. A model is known when it is canonical
    (`broker.model.GPU_MODELS`) or in `known()`: the names the policy declares
    (`extra_gpus`) and those offered in the pool now (a cloud's own name for a model the
    canonical table lacks, `Offer.gpu_known=False`). `known` is called only when a name
    is not canonical."""
    odd = [g for g in req.gpu if g not in GPU_MODELS]
    if not odd:
        return None
    others = set(known())
    bad = [g for g in odd if g not in others]
    if not bad:
        return None
    names = set(GPU_MODELS) | others
    return Invalid([{"field": "gpu", "message": unknown_gpu(g, names)} for g in bad],
                   req.request_id)


def unknown_gpu(name: str, known: Collection[str]) -> str:
    """"unknown GPU model 'H100'; did you mean 'H100-80GB'?": the nearest of `known`, or
    the canonical name the adapters would map it to (`nvidia-tesla-t4` -> `T4`)."""
    near = suggestions(name, known)
    mapped, canonical = gpus.canonical(name)
    if canonical and mapped != name and mapped not in near:
        near = [mapped]
    return unknown_name("GPU model", name, known, near)


def unknown_name(what: str, name: str, known: Collection[str],
                 near: Sequence[str] | None = None) -> str:
    """"unknown cloud 'gpc'; did you mean 'gcp'?", with the nearest of `known` (or those
    given as `near`); when none is near, the known names listed (up to 40)."""
    hint = did_you_mean(suggestions(name, known) if near is None else near)
    if not hint and known:
        listed = sorted(known)
        hint = f"; known: {', '.join(listed[:40])}{', ...' if len(listed) > 40 else ''}"
    return f"unknown {what} {name!r}{hint}"


def parse_lease_ref(payload: bytes) -> LeaseRef | Invalid:
    r = _validated(LeaseRefPayload, payload, echo_rid=False)
    return r if isinstance(r, Invalid) else LeaseRef(r.lease_id, r.epoch)


def parse_release(payload: bytes) -> LeaseRef | Invalid:
    """A `release`: by `lease_id` (and `epoch`), or by `request_id`; exactly one."""
    r = _validated(ReleasePayload, payload)
    if isinstance(r, Invalid):
        return r
    if (r.lease_id is None) == (r.request_id is None):
        return Invalid([{"field": "lease_id" if r.lease_id is None else "",
                         "message": "exactly one of lease_id and request_id"}],
                       r.request_id)
    if r.request_id is not None:
        if r.epoch is not None:
            return Invalid([{"field": "epoch", "message": "goes with lease_id (each part "
                             "of a split has its own epoch), not with request_id"}],
                           r.request_id)
        return LeaseRef("", None, r.request_id)
    assert r.lease_id is not None
    return LeaseRef(r.lease_id, r.epoch)


def parse_lookup(payload: bytes) -> str | Invalid:
    """A `lookup`: its `request_id`."""
    r = _validated(LookupPayload, payload)
    return r if isinstance(r, Invalid) else r.request_id


def echoed_lease_id(payload: bytes) -> str | None:
    """The `lease_id` a request's payload names, to echo in its `request.invalid`: a
    string of 1 to 128 characters, valid Unicode; None otherwise (or not a JSON object)."""
    data = _decode(payload)
    lease_id = data.get("lease_id") if isinstance(data, dict) else None
    if isinstance(lease_id, str) and 0 < len(lease_id) <= 128 and \
            _SURROGATE.search(lease_id) is None:
        return lease_id
    return None


def parse_report(payload: bytes) -> Report | Invalid:
    r = _validated(ReportPayload, payload, echo_rid=False)
    return r if isinstance(r, Invalid) else Report(r.lease_id, r.kind, r.detail, r.epoch)
