"""What `gpubroker demo` prints: the legend, the tally of what happened, the lines about a
placement and the summary at the end."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from broker.model import Placement

LEGEND = """\
Each line: the time, a tag, the request or lease. GPUs are written as instances × GPUs per
instance: "2 instances × 8 A100-80GB" is two 8-GPU machines, 16 GPUs.
  PLACED    a request got a lease: its GPUs, cloud/zone, instance type, market, price
            per GPU-hour, lease id
  AGAIN     a request sent again with the same request_id gets the lease it already has
            (never a second one), whatever that lease's state now
  REJECTED  nothing fits now; the reason code: no_capacity, over_price_cap, over_budget,
            policy_denied
  INVALID   a malformed request (the demo sends one now and then): the field at fault
  TIMEOUT   no answer from the daemon in time (the client sent the request again meanwhile)
  FAILOVER  a lease moved (reason in brackets): interrupted, capacity_lost,
            price_above_cap, cloud_unhealthy, reoptimized, ...
  FAILED    a lease that had to move found nowhere to go
  RELEASED  a scheduler gave a lease back
  EXPIRED   a scheduler stopped renewing a lease and it ran out
  RENEWED   every 10 s: the renewals since the last such line, and what is active now
  MQTT      the connection to the MQTT server was lost, or is back"""


def plural(count: int, word: str) -> str:
    """`1 lease`, `2 leases`."""
    return f"{count} {word}{'' if count == 1 else 's'}"


def gpus(p: Placement) -> str:
    """`2 instances × 8 A100-80GB`: never `16×A100-80GB`, which reads as one machine."""
    return f"{p.instances} instance{'s' if p.instances != 1 else ''} × {p.gpus} {p.gpu}"


def where(p: Placement) -> str:
    return (f"{gpus(p)} {p.pool.cloud}/{p.pool.zone} {p.pool.instance_type} "
            f"{p.pool.market.value} ${p.price_per_gpu_hour:.3f}/GPU-h")


def short_id(lease_id: str) -> str:
    return lease_id[:12]


@dataclass
class Tally:
    """What happened, for the summary."""

    placed: int = 0
    placed_gpus: int = 0
    again: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    invalid: int = 0
    timeouts: int = 0
    failovers: Counter[str] = field(default_factory=Counter)
    failed: int = 0
    renewed: int = 0
    renewed_since: int = 0  # since the last RENEWED line
    expired: int = 0
    released: int = 0  # by the schedulers while running
    released_at_exit: int = 0
    left_active: int = 0
    paid: float = 0.0  # Σ GPUs × $/GPU-h of new placements that have an on-demand price
    on_demand: float = 0.0  # Σ GPUs × the cheapest fresh on-demand $/GPU-h of the model
    priced_gpus: int = 0
    unpriced_gpus: int = 0  # placed GPUs of a model with no fresh on-demand offer


class MqttLines(logging.Handler):
    """The scheduler clients' news about the connection, as `MQTT` lines (once each,
    though both clients tell it)."""

    SHOWN = ("MQTT reconnected", "the daemon is online again")

    def __init__(self, say: Callable[[str, str], None]) -> None:
        super().__init__(logging.INFO)
        self._say = say
        self._last: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.levelno < logging.WARNING and not text.startswith(self.SHOWN):
            return
        now = time.monotonic()
        if now - self._last.get(text, -math.inf) < 5.0:
            return
        self._last[text] = now
        self._say("MQTT", text)


def summary(t: Tally, prefix: str, seconds: float, cleared: int, left: int,
            error: str | None) -> None:
    """The summary at the end: what happened, and what was cleared under `prefix`."""

    def by(counter: Counter[str]) -> str:
        return ", ".join(f"{k} {v}" for k, v in counter.most_common())

    rejected = sum(t.rejected.values())
    failovers = sum(t.failovers.values())
    lines = [
        ("placed", f"{plural(t.placed, 'lease')}, {plural(t.placed_gpus, 'GPU')}"
                   + (f"; {plural(t.again, 'request')} sent again got the lease already "
                      "given (AGAIN)" if t.again else "")),
        ("rejected", f"{rejected}" + (f": {by(t.rejected)}" if rejected else "")),
        ("invalid", f"{t.invalid}"),
        ("failovers", f"{failovers}" + (f": {by(t.failovers)}" if failovers else "")
                      + f"; failed {t.failed}"),
        ("renewed", f"{t.renewed}; expired {t.expired}"
                    + (f"; unanswered {t.timeouts}" if t.timeouts else "")),
        ("released", f"{t.released + t.released_at_exit}: {t.released} by the schedulers, "
                     f"{t.released_at_exit} at exit"
                     + (f"; {t.left_active} left active (not released: the MQTT server "
                        "did not answer)" if t.left_active else "")),
    ]
    if t.priced_gpus:
        paid = t.paid / t.priced_gpus
        od = t.on_demand / t.priced_gpus
        saved = 100 * (1 - t.paid / t.on_demand)
        lines.append(("price", f"${paid:.3f}/GPU-h paid on average for the "
                               f"{plural(t.priced_gpus, 'GPU')} placed, against "
                               f"${od:.3f}/GPU-h on demand for the same GPU models: "
                               f"{saved:.0f} % saved"
                               + (f" ({plural(t.unpriced_gpus, 'GPU')} of models with no "
                                  "on-demand offer left out)" if t.unpriced_gpus else "")))
    else:
        lines.append(("price", "nothing placed"))
    if error is not None:
        lines.append(("retained", f"not cleared under {prefix}: the MQTT server "
                                  f"did not answer ({error})"))
    else:
        lines.append(("retained", f"{cleared} message{'' if cleared == 1 else 's'} cleared "
                                  f"under {prefix}"
                                  + (f"; {left} still there" if left else "")))
    print(f"Summary of {seconds:.0f} s:", flush=True)
    for name, text in lines:
        print(f"  {name:<11}{text}", flush=True)
