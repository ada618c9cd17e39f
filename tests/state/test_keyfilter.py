"""The key filter: never a false "no"; few false "maybe"s; full means it answers nothing."""

from __future__ import annotations

from broker.state.keyfilter import KeyFilter


def test_every_added_key_may_be_held_and_few_others_are() -> None:
    keys = KeyFilter(capacity=10_000)
    for i in range(10_000):
        keys.add("sched-a", f"r{i}")
    assert all(keys.may_hold("sched-a", f"r{i}") for i in range(10_000))
    false = sum(keys.may_hold("sched-a", f"new-{i}") for i in range(20_000))
    assert false / 20_000 < 0.02  # about 1 % at capacity
    # The scheduler is part of the key: another scheduler's r1 is (almost surely) not held.
    assert sum(keys.may_hold("sched-b", f"r{i}") for i in range(10_000)) < 300


def test_a_filter_past_its_capacity_answers_maybe_for_everything() -> None:
    keys = KeyFilter(capacity=10)
    for i in range(11):
        keys.add("s", f"r{i}")
    assert keys.full
    assert keys.may_hold("s", "never-added")


def test_sized_for_leaves_room_for_twice_the_stored_keys() -> None:
    assert KeyFilter.sized_for(10).capacity >= 1 << 20
    assert KeyFilter.sized_for(3_000_000).capacity == 6_000_000
