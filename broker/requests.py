"""Validation of what schedulers send (SPEC §3, §4).

Anything a scheduler sends is untrusted: bad JSON, wrong types and out-of-range values
come back as a list of `{"field", "message"}` errors, never as an exception that could
reach the daemon's loops. Unknown fields are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError

from broker.model import PlaceRequest

FieldError = dict[str, str]

_Name = Annotated[StrictStr, Field(min_length=1, max_length=64)]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _Place(_Lenient):
    request_id: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    gpu: _Name | Annotated[list[_Name], Field(min_length=1, max_length=16)]
    gpus: Annotated[int, Field(ge=1, le=4096)]
    gang: StrictBool = True
    market: Literal["spot", "on_demand", "any"] | None = None
    max_price_per_gpu_hour: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    clouds: Annotated[list[_Name], Field(min_length=1, max_length=16)] | None = None
    regions: Annotated[list[_Name], Field(min_length=1, max_length=256)] | None = None
    team: _Name | None = None
    duration_hours: Annotated[float, Field(gt=0, le=24 * 366,
                                           allow_inf_nan=False)] | None = None
    lease_seconds: Annotated[int, Field(ge=1, le=7 * 86400)] | None = None
    labels: Annotated[dict[_Name, Annotated[StrictStr, Field(max_length=256)]],
                      Field(max_length=64)] | None = None


class _LeaseRef(_Lenient):
    lease_id: Annotated[StrictStr, Field(min_length=1, max_length=128)]


class _Report(_LeaseRef):
    kind: Literal["interrupted", "launch_failed", "unhealthy"]
    detail: Annotated[StrictStr, Field(max_length=1024)] | None = None


@dataclass(frozen=True, slots=True)
class Invalid:
    errors: list[FieldError]
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class LeaseRef:
    lease_id: str


@dataclass(frozen=True, slots=True)
class Report:
    lease_id: str
    kind: str
    detail: str | None


def _decode(payload: bytes) -> dict[str, Any] | Invalid:
    try:
        data = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return Invalid([{"field": "", "message": f"not valid JSON: {exc}"}])
    if not isinstance(data, dict):
        return Invalid([{"field": "", "message": "expected a JSON object"}])
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


def parse_place(scheduler: str, payload: bytes) -> PlaceRequest | Invalid:
    data = _decode(payload)
    if isinstance(data, Invalid):
        return data
    rid = data.get("request_id")
    rid = rid if isinstance(rid, str) and len(rid) <= 128 else None
    try:
        p = _Place.model_validate(data)
    except ValidationError as err:
        return Invalid(_errors(err), rid)
    return PlaceRequest(
        scheduler=scheduler,
        request_id=p.request_id,
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
    )


def parse_lease_ref(payload: bytes) -> LeaseRef | Invalid:
    data = _decode(payload)
    if isinstance(data, Invalid):
        return data
    try:
        return LeaseRef(_LeaseRef.model_validate(data).lease_id)
    except ValidationError as err:
        return Invalid(_errors(err))


def parse_report(payload: bytes) -> Report | Invalid:
    data = _decode(payload)
    if isinstance(data, Invalid):
        return data
    try:
        r = _Report.model_validate(data)
    except ValidationError as err:
        return Invalid(_errors(err))
    return Report(r.lease_id, r.kind, r.detail)
