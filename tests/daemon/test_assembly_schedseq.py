"""`schedseq`: each scheduler's events numbered 1, 2, 3, … across daemon restarts, kept in
the state store with the events (contract 1.1 §5.1, #29)."""

from __future__ import annotations

from pathlib import Path

from daemon_helpers import PREFIX, StartDaemon
from mqtt_helpers import ProbeFactory, payload_json


async def test_schedseq_is_gapless_per_scheduler_across_a_restart(
        start_daemon: StartDaemon, probe_factory: ProbeFactory, tmp_path: Path) -> None:
    state = tmp_path / "state.db"
    probe = await probe_factory([f"{PREFIX}/events/#"])
    events = f"{PREFIX}/events/+/+"

    async def ask(scheduler: str, verb: str, body: object) -> None:
        await probe.publish(f"{PREFIX}/requests/{scheduler}/{verb}", body)

    def place(request_id: str) -> dict[str, object]:
        return {"request_id": request_id, "gpu": ["A100-80GB", "H100-80GB"], "gpus": 1}

    first = await start_daemon(state=state)
    for i in range(3):
        await ask("a", "place", place(f"a-{i}"))
        await ask("b", "place", place(f"b-{i}"))
    await ask("a", "place", b"{not json")  # answered request.invalid: numbered too
    await probe.wait_for_count(events, 7)
    await first.stop()
    second = await start_daemon(state=state)
    assert second.daemon.boot_id != first.daemon.boot_id
    for i in range(2):
        await ask("a", "place", place(f"a-again-{i}"))
    await ask("b", "place", place("b-0"))  # a repeat: answered, and numbered
    got = await probe.wait_for_count(events, 10)

    by_scheduler: dict[str, list[int]] = {}
    boots: set[str] = set()
    for message in got:
        ev = payload_json(message)
        scheduler = str(message.topic).split("/")[-2]
        by_scheduler.setdefault(scheduler, []).append(ev["schedseq"])
        boots.add(ev["bootid"])
    assert len(boots) == 2
    assert by_scheduler == {"a": [1, 2, 3, 4, 5, 6], "b": [1, 2, 3, 4]}
