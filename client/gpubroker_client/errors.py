"""The errors the client raises: every one a `BrokerError`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpubroker_client.model import LeaseState

__all__ = ["BrokerError", "BrokerUnavailable", "InvalidRequest", "LeaseEnded",
           "PlacementTimeout", "Rejected", "RequestTimeout"]


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
    """`placement.rejected`: `code` is `no_capacity`, `over_price_cap`, `over_budget` or
    `policy_denied`; `retry_after` (seconds) when the daemon suggests one."""

    def __init__(self, code: str, detail: str, retry_after: float | None,
                 request_id: str, event: Mapping[str, Any] | None = None) -> None:
        hint = f" (retry after {retry_after:g}s)" if retry_after is not None else ""
        super().__init__(f"{code}: {detail}{hint}")
        self.code = code
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
