"""The composition root: builds the parts, runs them in one task group, shuts down in order.

Start-up: state store → lease book and outbox restored → MQTT → adapters → polling;
requests are taken once the first round of polls is in. The market recorder listens to
the pool from the start and writes on the store's thread. Shutdown (SIGTERM/SIGINT) runs
in reverse: stop taking requests, finish the decisions in flight, flush the outbox,
publish `offline`, disconnect, close the store and the adapters. A commit the state
store refuses ends the task group at once instead (crash-only, see `broker.leasing.authority`):
`run` raises `StoreFailed`, and the next start recovers from the store.
"""

from broker.daemon.assembly.daemon import Daemon
from broker.daemon.assembly.process import install_signal_handlers

__all__ = ["Daemon", "install_signal_handlers"]
