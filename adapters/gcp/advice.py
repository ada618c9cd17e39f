"""Compute Engine's capacity advice (`regions.advice.capacity`): GCP's own capacity and
preemption signal, read per zone, GPU shape and provisioning model.

**The call** (REST reference, method `advice.capacity`; google-cloud-compute's
`AdviceClient.capacity`, whose REST transport posts to
``/compute/v1/projects/{project}/regions/{region}/advice/capacity``; the reference
documents it under ``/compute/beta/...``). One request asks about one shape, one
provisioning model and one zone, for one VM::

    {"instanceProperties": {"scheduling": {"provisioningModel": "SPOT" | "STANDARD"}},
     "instanceFlexibilityPolicy": {"instanceSelections": {"gpubroker": {
         "machineTypes": ["n1-standard-8"],
         "guestAccelerators": [{"acceleratorType": "nvidia-tesla-t4",
                                "acceleratorCount": 1}]}}},      # N1 + GPU shapes only
     "size": 1,
     "distributionPolicy": {"zones": [{"zone": "zones/us-central1-a"}],
                            "targetShape": "ANY_SINGLE_ZONE"}}

and the answer is ``{"recommendations": [{"scores": {"obtainability": 0.83,
"estimatedUptime": "25200s"}, "shards": [{"zone": ..., "machineType": ...,
"provisioningModel": ..., "instanceCount": 1}]}]}`` (`CapacityAdviceResponse`: "Initially
the API will provide one recommendation"; its scores are for the whole request, so a
score per zone takes a request per zone).

**The reading.** `obtainability` — "the likelihood of successfully obtaining
(provisioning) the requested number of VMs. The score range is 0.0 through 1.0" — is
the offer's `availability`. `estimatedUptime`, a protobuf Duration in JSON ("25200s"),
is "The estimated run time of the majority of Spot VMs in the request before
preemption" (the API reference); the guide "View the availability of Spot VMs" words it
"the minimum amount of time that you can expect most of your Spot VMs to run before
Compute Engine preempts them". Neither says it is a mean: it is a time that most
(at least half) of the VMs outlive, so it is read as a median, and the Spot offer's
`interruption_rate` is the one interruption model's hazard with half the VMs reclaimed
by it: ``ln 2 / hours`` (`adapters.hazard.hazard_from_uptime`). It is only read on Spot
answers; an on-demand VM is not preempted.

**Permission**: `compute.advice.capacity` (in `roles/compute.viewer`). Without it the
call answers 403: the adapter remembers that, logs it once and keeps learning
stock-outs from launch failures instead.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from adapters.gcp.pricing import Shape
from adapters.hazard import hazard_from_uptime
from broker.model import Market

PERMISSION = "compute.advice.capacity"
SELECTION = "gpubroker"  # the instance selection's key: any RFC 1035 name
MODELS = {Market.ON_DEMAND: "STANDARD", Market.SPOT: "SPOT"}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s*$")


@dataclass(frozen=True, slots=True)
class Advice:
    """What one answer says about one pool."""

    obtainability: float | None  # 0..1, None: not given
    uptime_hours: float | None = None  # Spot only; None: not given

    @property
    def interruption_rate(self) -> float | None:
        """Interruptions per hour (see the module doc), None without an uptime."""
        if self.uptime_hours is None:
            return None
        return hazard_from_uptime(self.uptime_hours)


def request(zone: str, shape: Shape, market: Market) -> dict[str, Any]:
    """The REST body asking about one VM of `shape` in `zone` in `market`'s model."""
    selection: dict[str, Any] = {"machineTypes": [shape.machine_type]}
    if shape.machine_type != shape.instance_type:  # N1 + GPU: the GPUs are attached
        selection["guestAccelerators"] = [{"acceleratorType": shape.accelerator,
                                           "acceleratorCount": shape.gpus}]
    return {"instanceProperties": {"scheduling": {"provisioningModel": MODELS[market]}},
            "instanceFlexibilityPolicy": {"instanceSelections": {SELECTION: selection}},
            "size": 1,
            "distributionPolicy": {"zones": [{"zone": f"zones/{zone}"}],
                                   "targetShape": "ANY_SINGLE_ZONE"}}


def duration_hours(value: Any) -> float | None:
    """A protobuf Duration in its JSON form ("1800s", "5400.5s") in hours; None for
    anything else, zero or negative."""
    m = _DURATION.match(value) if isinstance(value, str) else None
    if m is None:
        return None
    seconds = float(m.group(1))
    return seconds / 3600 if seconds > 0 and math.isfinite(seconds) else None


def parse(answer: Any, market: Market) -> Advice | None:
    """The advice of one answer (`CapacityAdviceResponse` as REST JSON): the first
    recommendation's scores. None when it has none; `ValueError` when they do not read
    (an obtainability outside 0..1, a field of the wrong type)."""
    if not isinstance(answer, dict):
        raise ValueError(f"the answer is not an object: {type(answer).__name__}")
    recommendations = answer.get("recommendations") or []
    if not isinstance(recommendations, list):
        raise ValueError("recommendations is not a list")
    if not recommendations:
        return None
    first = recommendations[0]
    scores = first.get("scores") if isinstance(first, dict) else None
    if not isinstance(scores, dict):
        return None
    raw = scores.get("obtainability")
    obtainability: float | None = None
    if raw is not None:
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise ValueError(f"obtainability {raw!r} is not a number")
        if not (math.isfinite(raw) and 0.0 <= raw <= 1.0):
            raise ValueError(f"obtainability {raw!r} is outside 0..1")
        obtainability = float(raw)
    uptime = None
    if market is Market.SPOT and scores.get("estimatedUptime") is not None:
        uptime = duration_hours(scores["estimatedUptime"])
        if uptime is None:
            raise ValueError(f"estimatedUptime {scores['estimatedUptime']!r} is not a "
                             "positive duration")
    if obtainability is None and uptime is None:
        return None
    return Advice(obtainability, uptime)
