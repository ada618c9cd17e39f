"""The schedulers' client moved to its own package, `gpubroker_client` (client/, the
`gpubroker-client` distribution; `gpubroker` ships it too). This module re-exports its
public API for one release, so `from broker.client import BrokerClient` keeps working;
import `gpubroker_client` instead. (No DeprecationWarning at import: a warning here would
fail every test run under filterwarnings=error that still imports this path.)"""

from __future__ import annotations

from gpubroker_client import (
    DEFAULT_PREFIX,
    BrokerClient,
    BrokerError,
    BrokerUnavailable,
    InvalidRequest,
    Lease,
    LeaseChange,
    LeaseEnded,
    LeaseEvent,
    LeaseWatch,
    PlacementTimeout,
    Rejected,
    RequestTimeout,
    parse_mqtt_url,
)

__all__ = [
    "DEFAULT_PREFIX",
    "BrokerClient",
    "BrokerError",
    "BrokerUnavailable",
    "InvalidRequest",
    "Lease",
    "LeaseChange",
    "LeaseEnded",
    "LeaseEvent",
    "LeaseWatch",
    "PlacementTimeout",
    "Rejected",
    "RequestTimeout",
    "parse_mqtt_url",
]
