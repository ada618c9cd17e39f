"""The assignment problem behind placement, and its two solvers.

A batch of requests is a generalised assignment problem: each request takes one of its
options (a pool and a number of instances) or stays unplaced; options use up shared
resources (a pool's free instances, a quota group's headroom, a team's GPUs and budget)
and a team's GPUs may not crowd into one zone or cloud beyond a share (the spread limit).
Minimise the options' costs plus a penalty for every request left unplaced; the penalty
is larger than any option of that request, so the solvers place as much as they can first
and then place it as cheaply as they can.

* `heuristic` — regret-based greedy (the request that would lose most by waiting goes
  first; ties by arrival order, so nothing starves behind later requests; the requests
  of a team short of GPUs or budget for the batch go before all others, most valuable
  per GPU or $ first) plus local improvement (move a request to a cheaper option that
  has become free; re-try unplaced requests, making room by moving the placed requests
  in their way; in a team short of GPUs or budget, swap its least valuable placed
  requests for a more valuable unplaced one), then two phases bounded in work (`RECLAIM`
  requests each) and by the deadline: a team whose budget or spread limit leaves
  requests unplaced moves its placed ones to options of lower price, or out of the zone
  or cloud at its share, each $ or GPU weighed at what its unplaced ones are worth per $
  or GPU, and places them in what that spares (kept if the objective is lower); then the
  requests placed furthest above their cheapest option take a cheaper one, moving the
  requests in its way on when that costs less (the greedy's regret looks one option
  ahead: a long request may find the cheap pools taken by short ones that lose little
  elsewhere). Linear-ish in the number of requests; used for every batch.
* `exact` — the mixed-integer program solved by HiGHS (highspy, its Python interface), with a
  time limit. Its LP relaxation is solved first by column generation over each request's
  options (cheapest first) until no left-out option could lower it: a valid lower bound
  for the whole problem, not only for the options looked at. Options whose reduced cost
  exceeds the gap between the heuristic's answer and that bound cannot be in a better
  solution; the MILP gets every other option, so an optimal MILP answer is the optimum.

Pure and synchronous; it knows nothing of clouds. `broker.placement.optimizer` builds problems
from the pool and the policy and turns solutions into decisions.

The parts: the problem's types (`broker.placement.problem`), the residual resources and the
teams' tallies of an answer (`broker.placement.residual`; the team limits themselves are
`policies.teams`), the heuristic (`broker.placement.heuristic`) and the exact solver
(`broker.placement.milp`); this module gathers their names.
"""

from __future__ import annotations

from broker.placement.heuristic import (
    RECLAIM,
    _improve,
    _make_room,
    _reclaim,
    _spare_limits,
    _team_swaps,
    heuristic,
)
from broker.placement.milp import _LP, PRICE_STEP, Stop, _price_out, exact, preload
from broker.placement.problem import (
    EPS,
    Alive,
    AssignmentProblem,
    Group,
    More,
    Option,
    Request,
    Shrinking,
    Solution,
)
from broker.placement.residual import State, trivial_bound, why_unplaced
from policies.teams import TeamRoom

__all__ = [
    "EPS", "PRICE_STEP", "RECLAIM", "_LP", "Alive", "AssignmentProblem", "Group", "More",
    "Option", "Request", "Shrinking", "Solution", "State", "Stop", "TeamRoom", "_improve",
    "_make_room", "_price_out", "_reclaim", "_spare_limits", "_team_swaps", "exact",
    "heuristic", "preload", "trivial_bound", "why_unplaced",
]
