"""The errors the client raises: every one a `BrokerError`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpubroker_client.events import RejectCode
from gpubroker_client.model import LeaseState

__all__ = ["BrokerError", "BrokerUnavailable", "InvalidRequest", "LeaseEnded",
           "PlacementTimeout", "Rejected", "ReportDeclined", "RequestTimeout", "StaleEpoch"]


class BrokerError(Exception):
    """Base of every error this client raises."""


class BrokerUnavailable(BrokerError):
    """The MQTT server could not be reached (or refused the connection) in time."""


class RequestTimeout(BrokerError, TimeoutError):
    """No answer from the daemon before the deadline (it was asked again meanwhile)."""


class PlacementTimeout(RequestTimeout):
    """`place()` had no answer before its deadline. Calling `place()` again with the same
    `request_id` is safe: it gets the lease if one was decided meanwhile."""

    def __init__(self, message: str, request_id: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class Rejected(BrokerError):
    """`placement.rejected`: `code` is a `RejectCode` (`no_capacity`, `over_price_cap`,
    `over_budget`, `policy_denied`; a code this client does not know stays a `str`);
    `retry_after` (seconds) when the daemon suggests one."""

    def __init__(self, code: str, detail: str, retry_after: float | None,
                 request_id: str, event: Mapping[str, Any] | None = None) -> None:
        hint = f" (retry after {retry_after:g}s)" if retry_after is not None else ""
        super().__init__(f"{code}: {detail}{hint}")
        self.code: RejectCode | str = RejectCode(code) if code in RejectCode._value2member_map_ \
            else code
        self.detail = detail
        self.retry_after = retry_after
        self.request_id = request_id
        self.event = event


class InvalidRequest(BrokerError, ValueError):
    """`request.invalid`: `errors` is a list of `{"field", "message"}`."""

    def __init__(self, errors: Sequence[Mapping[str, str]], request_id: str | None = None,
                 event: Mapping[str, Any] | None = None) -> None:
        self.errors = [{"field": str(e.get("field", "")), "message": str(e.get("message", ""))}
                       for e in errors]
        self.request_id = request_id
        self.event = event
        super().__init__("; ".join(f"{e['field'] or '(request)'}: {e['message']}"
                                   for e in self.errors) or "invalid request")

    @property
    def fields(self) -> list[str]:
        return [e["field"] for e in self.errors]


class LeaseEnded(BrokerError):
    """The lease has ended (`state`: released, expired or failed): it cannot be renewed
    or reported on."""

    def __init__(self, lease_id: str, state: LeaseState, detail: str | None = None) -> None:
        super().__init__(f"lease {lease_id} has {state.value}"
                         + (f": {detail}" if detail else ""))
        self.lease_id = lease_id
        self.state = state
        self.detail = detail


class ReportDeclined(BrokerError):
    """`report.declined`: the daemon's anti-flap limits held the report back; nothing
    moved. `retry_after` (seconds, `retry_after_seconds`): when a report may act again;
    `reason` is for people."""

    def __init__(self, lease_id: str, epoch: int, kind: str, reason: str,
                 retry_after: float, event: Mapping[str, Any] | None = None) -> None:
        super().__init__(f"report {kind} on lease {lease_id} (epoch {epoch}) declined: "
                         f"{reason} (retry after {retry_after:g}s)")
        self.lease_id = lease_id
        self.epoch = epoch
        self.kind = kind
        self.reason = reason
        self.retry_after = retry_after
        self.event = event


class StaleEpoch(BrokerError):
    """`lease.current`: the request named an epoch older than the lease's (it moved
    since); nothing was done. `epoch` is the lease's current one, `stale_epoch` the one
    sent, `state` the lease's state (as on `P/leases/S/<id>`). Raised only by the verbs
    by lease id (`BrokerClient.renew/release/report`); a held `Lease` updates itself."""

    def __init__(self, lease_id: str, epoch: int, stale_epoch: int | None,
                 state: Mapping[str, Any]) -> None:
        super().__init__(f"lease {lease_id} is at epoch {epoch}, not {stale_epoch}: "
                         "nothing was done")
        self.lease_id = lease_id
        self.epoch = epoch
        self.stale_epoch = stale_epoch
        self.state = state
