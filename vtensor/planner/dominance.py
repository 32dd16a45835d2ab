"""Which candidate recomputations cannot be faster than one already tried or replayed (pure).

NOTE [dominated candidates]
A candidate that recomputes all that a profiled plan which moves nothing recomputes, and more,
can move nothing less and computes more: it is not faster, so it gets neither a trial nor a
place in the race. On the main job's smallest class the cheapest cover recomputed
``features.2.body`` and ``features.3`` and moved nothing, and ``features.2, features.3`` whole
was tried and raced too. A module is recomputed by the candidate's own recomputation of it or
of an ancestor, whole, or selectively where it is recomputed selectively (a selective unit
recomputes all but the products inside it). What checkpointing every block does is not dropped
after a trial (``kept`` in ``activations/iteration_plan.py``): a plan that moved nothing in its
trial may need the guard in its first replay and be made again under the guard's margin (NOTE
[guard margin] in ``activations/margin.py``), moving bytes then. Once such a plan's full replay
needed nothing from the guard, it runs as kept from then on, and every candidate of the race
that recomputes all it does and more, checkpointing every block included, leaves the race
(``PlanRace.record`` in ``activations/race.py``), as does every one the profile prices higher
(NOTE [outdone in the race]).

NOTE [outdone in the race]
Plans that move nothing differ only by what they recompute. The race times them under whatever
else the machine runs: in the main job a second client trains beside the one deciding, and two
processes replaying the same plan side by side took 47-62 and 50-80 ms a step (10th-90th
percentile, benchmarks/README.md, ``main_job``), so four to eight replays each tell two covers
apart only where they differ by more than several milliseconds, and the micro class kept a
three- or four-module cover (1.37x the unmanaged round in a run where the two-module cover took
1.22-1.31x) now and then. The profile prices each unit's recomputation from its forward run
again alone, the lesser of two runs, and the mechanism's measured cost (NOTE [unit time] in
``activations/units.py``), and two covers of one profile are priced from the same figures: the
main job's micro covers were priced 5.1-9.2 ms, a unit's price varying by about 10 % from
profile to profile. So once a plan that moves nothing has a clean full replay, every candidate
of the same encoding whose recomputation is priced higher leaves the race: moving nothing less
and recomputing more, it could win only by the noise of the replays. Plans that move bytes, the
swap-only one included, still race on their times: the model does not see what swapping costs
on a CPU (NOTE [plan race]).

NOTE [predicted behind]
The race times candidates because the model's prediction ranked swapping against
recomputation wrongly (NOTE [plan race]); two plans that both move nothing differ only by what
they recompute, and the profile measured that: each unit's forward run again alone, and the
mechanism's own cost (NOTE [unit time] in ``activations/units.py``). So once a trial's plan
moves nothing, a pending candidate (but checkpointing every block, as above) whose predicted
recomputation costs more than that trial's by over ``BEHIND`` of the step is not tried: the race
would find it that much slower, and a candidate more than ``CLOSE`` (the same share) behind
the leader is not replayed past its first rounds anyway. The step is estimated as three times
the outermost units' forward (a backward costs about twice its forward): on the main job's CNN
35.6 ms, against 36-40 ms measured unmanaged. The profile's own step durations are no
estimate: recorded at every hook, the CNN's forward steps took 38.8 ms where its units' forward
run again took 11.9 ms. Units predicted cheaper than measured (NOTE [mechanism cost] in
``activations/rerun_cost.py``: a block recomputed whole added 0.3-1.1 ms more than predicted)
err towards the candidate that recomputes more modules, so a candidate predicted behind is
behind at least as much. On the main job's micro class, the cheapest cover (two to five
modules) moved nothing, and every block selectively (twelve modules) and every block whole
were predicted 5-10 ms behind a 40 ms step: two trials of 0.13-0.15 s and four replays fewer.
"""

from collections.abc import Mapping, Sequence

from vtensor.planner.recomputed import whole_s
from vtensor.planner.trace import Trace, TraceUnit

Candidate = tuple[tuple[str, ...], tuple[str, ...]]  # (modules, those recomputed selectively)

BEHIND = 0.10  # the race's CLOSE: a share of the step (NOTE [predicted behind])
STEP_PER_FORWARD = 3.0  # a step: the forward, and a backward of about twice its time


def recomputes_all_of(candidate: Candidate, names: Sequence[str], selective: Sequence[str]) -> bool:
    """Whether ``candidate`` recomputes everything ``names`` (``selective`` so) recomputes.

    NOTE [dominated candidates].
    """
    others, partial = candidate

    def covered(name: str) -> bool:
        return any(
            (name == other or name.startswith(other + "."))
            and (other not in partial or name in selective)
            for other in others
        )

    return all(covered(name) for name in names)


def unit_costs(trace: Trace) -> dict[str, tuple[float, float]]:
    """Per safe unit, what recomputing it costs: (whole, selectively) seconds, priced as chosen."""
    return {u.name: (whole_s(u), u.selective_s) for u in trace.units if u.safe}


def step_estimate_s(trace: Trace) -> float:
    """The step's time estimated from its outermost units' forward (NOTE [predicted behind])."""
    units = trace.units
    return STEP_PER_FORWARD * sum(u.forward_s for u in units if not _inside_any(u, units))


def recompute_s(costs: Mapping[str, tuple[float, float]], candidate: Candidate) -> float | None:
    """What ``candidate`` is predicted to recompute for, in seconds (None: a unit not priced)."""
    names, selective = candidate
    if any(n not in costs for n in names):
        return None
    return sum(costs[n][n in selective] for n in names)


def priced_above(
    costs: Mapping[str, tuple[float, float]], candidate: Candidate, than: Candidate
) -> bool:
    """Whether ``candidate``'s recomputation is priced above ``than``'s (both priced).

    NOTE [outdone in the race].
    """
    mine, theirs = recompute_s(costs, candidate), recompute_s(costs, than)
    return mine is not None and theirs is not None and mine > theirs


def predicted_behind(
    costs: Mapping[str, tuple[float, float]], step_s: float, candidate: Candidate, than: Candidate
) -> bool:
    """Whether ``candidate`` costs more than ``than`` by over ``BEHIND`` of ``step_s``.

    Only where both are priced and the step is known (NOTE [predicted behind]).
    """
    mine, theirs = recompute_s(costs, candidate), recompute_s(costs, than)
    if mine is None or theirs is None or step_s <= 0:
        return False
    return mine - theirs > BEHIND * step_s


def _inside_any(unit: TraceUnit, units: Sequence[TraceUnit]) -> bool:
    return any(unit.name.startswith(other.name + ".") for other in units)
