"""Room in a pool for a request: the one formula the capacity rule (`rules.CAPACITY`),
the walk's pass over offers without room and the `CostIndex`'s parts of its lists
(`broker.placement.view.Part`) read. A module of its own because the index's module
is below the rules' (they read its `PoolView`)."""

from __future__ import annotations

from typing import Any

from broker.model import Offer


def instances_for(need: int, gpus: Any) -> Any:
    """Instances of `gpus` GPUs each that `need` GPUs take (per offer, for arrays too)."""
    return -(-need // gpus)


def fits(o: Offer, held: int, n: int) -> bool:
    """Whether `n` instances fit in the offer's capacity when `held` of it are held."""
    return o.capacity is None or o.capacity - held >= n


def no_room(offer: Offer, held: int, need: int) -> bool:
    """Whether the offer has no room for the instances `need` GPUs take when `held` of
    it are held (a view's `PoolView.held`): then it fails `capacity` for a request of
    `need` GPUs judged on that view, whatever a pass has taken besides (`Probe.held`
    only adds to the view's). What a walk may skip without judging
    (`broker.placement.walk`); the rule stays the judge. It holds for any smaller
    request too: one with room for `need` GPUs has room for fewer."""
    return not fits(offer, held, instances_for(need, offer.gpus))
