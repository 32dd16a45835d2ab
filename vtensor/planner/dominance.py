"""Which candidate recomputations cannot be faster than one already tried or replayed (pure).

NOTE [dominated candidates]
A candidate that recomputes all that a profiled plan which moves nothing recomputes, and more,
can move nothing less and computes more: it is not faster, so it gets neither a trial nor a
place in the race; nor does one whose recomputation the profile prices higher (NOTE [priced
higher]). On the main job's smallest class the cheapest cover recomputed ``features.2.body`` and
``features.3`` and moved nothing, and ``features.2, features.3`` whole was tried and raced too
(before a block's wrapper was left out of the units: NOTE [one unit per tensors] in
``activations/units.py``). A module is recomputed by the candidate's own recomputation of it or
of an ancestor, whole, or selectively where it is recomputed selectively (a selective unit
recomputes all but the products inside it). What checkpointing every block does is not dropped
after a trial (``kept`` in ``activations/iteration_plan.py``): a plan that moved nothing in its
trial may need the guard in its first replay and be made again under the guard's margin (NOTE
[guard margin] in ``activations/margin.py``), moving bytes then. Once such a plan's full replay
needed nothing from the guard, it runs as kept from then on, and every candidate of the race
that recomputes all it does and more, or is priced higher, checkpointing every block included,
leaves the race (``PlanRace.record`` in ``activations/race.py``).

NOTE [priced higher]
Plans that move nothing differ only by what they recompute. The race times them under whatever
else the machine runs: in the main job a second client trains beside the one deciding, and two
processes replaying the same plan side by side took 47-62 and 50-80 ms a step (10th-90th
percentile, benchmarks/README.md, ``main_job``), so four to eight replays each tell two covers
apart only where they differ by more than several milliseconds: the micro class kept a three-
or four-module cover now and then (1.36x the unmanaged round in a run where two-module covers
took 1.22-1.31x). The profile prices each unit's recomputation from its forward run again
alone, the lesser of two runs, and the mechanism's measured cost (NOTE [unit time] in
``activations/units.py``), and the covers of one profile are priced from the same figures: the
micro class's candidates were priced 5.1-9.2 ms, a unit's price varying by about 10 % from
profile to profile. So once a trial's plan moves nothing, the candidates still to try whose
recomputation is priced higher are not tried (but checkpointing every block, as above), and
once a plan that moves nothing has a clean full replay, every candidate of the same encoding
priced higher leaves the race: moving nothing less and recomputing more, it could win only by
the replays' noise. Plans that move bytes, the swap-only one included, still race on their
times: the model does not see what swapping costs on a CPU (NOTE [plan race]). Until every
candidate has been timed, the plan the decider publishes for its followers (NOTE [provisional
plan] in ``activations/shared_plans.py``) is the one that moves nothing priced least, where one
does, not the one its trial's trace predicted fastest: traced at every hook, the micro class's
trials predicted 0.11-0.14 s a step against 40-50 ms replayed, and ranked every block whole
(0.112 s) ahead of a two-module cover (0.135 s).
"""

from collections.abc import Mapping, Sequence

from vtensor.planner.plan import Plan
from vtensor.planner.recomputed import whole_s
from vtensor.planner.trace import Trace

Candidate = tuple[tuple[str, ...], tuple[str, ...]]  # (modules, those recomputed selectively)


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
    """Per safe unit, what recomputing it costs: (whole, selectively) seconds."""
    return {u.name: (whole_s(u), u.selective_s) for u in trace.units if u.safe}


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

    NOTE [priced higher].
    """
    mine, theirs = recompute_s(costs, candidate), recompute_s(costs, than)
    return mine is not None and theirs is not None and mine > theirs


def likely_fastest(plans: Sequence[Plan], costs: Mapping[str, tuple[float, float]]) -> Plan | None:
    """Of ``plans`` not yet timed, the one to run meanwhile (NOTE [priced higher]).

    Of those that move nothing, the one whose recomputation is priced least; else the one
    predicted fastest. None where ``plans`` is empty.
    """
    priced = [
        (seconds, i)
        for i, p in enumerate(plans)
        if not p.moves and (seconds := recompute_s(costs, (p.recompute, p.selective))) is not None
    ]
    if priced:
        return plans[min(priced)[1]]
    return min(plans, key=lambda p: p.predicted_step_s or float("inf"), default=None)
