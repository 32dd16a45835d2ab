"""The guard's headroom point by point: how far the bytes rose after it acted there (pure).

NOTE [step reserve]
Between two points where the guard can act (a step's start, a saved tensor's pack, an unpack)
the tracked bytes can rise where no hook can make room (an op's output, a concatenation and
what consumes it, a backward node's working set), so the guard keeps headroom under the budget
while a plan is replayed. Kept as one figure, the largest rise anywhere in the iteration, at
every point, it sat under the plan's own peak wherever one step rises far more than the rest:
a DenseNet's last layer concatenates every earlier feature (56 MiB, 4-32 MiB elsewhere), so a
plan that recomputed every layer, moved nothing and fitted the budget with 7 MiB to spare had
its guard evict 22 MiB at every replay (benchmarks/README.md, ``held_out``), and on a small
DenseNet at half its peak the guard moved as much again as the plan
(``tests/vtensor/activations/test_step_reserve.py``). Per step it would still sit under the
peak: the reading after a backward node's working set, the step's peak, would be given that
working set again. So the profile books, to each point where the guard acted (the step, and
the point's place among the step's hook events: its start, then each pack, unpack and
backward node, in order, the same in every iteration of one plan), how far the readings rose
above it before the guard could act again, less what the manager announced or did itself in
between (parameters read, restores started, recomputations: a replayed plan places those);
``TraceStep.growth_bytes`` holds them, ``Plan.step_reserve_bytes`` carries them. While a replay
follows the plan, the guard keeps at each point what followed it in the profile (at least its
one chunk); a lean replay reads and guards at boundaries only, so with the headroom of the
step's start, which its full replay kept without needing the guard (NOTE [lean replay]). A
joint plan with parameter offloading and a replay that has left its plan keep the largest rise
everywhere, as before, and so does a plan made under the largest rise (plans still are, where
they can be): the headroom per point is for the plans that fill the budget, where the largest
rise cannot be left free (``step_guard``). Kept for every plan, it let MobileNetV2's swap plan
at 40 % of its peak replay lean (44 heap readings a step instead of 1055), but a transformer's
replay then broke the budget once under ``MALLOC_PERTURB_``: one profile's rise at a point
bounds no other replay's, and a plan made under the largest rise was proven with it
(benchmarks/README.md, ``activation_swap``).
"""

from vtensor.planner.plan import Plan
from vtensor.planner.trace import Trace


def step_reserves(trace: Trace) -> tuple[tuple[int, ...], ...]:
    """Per step of ``trace``, the rise after each hook event the guard acted at; empty if none."""
    reserves = tuple(s.growth_bytes for s in trace.steps)
    return reserves if any(reserves) else ()


def step_guard(plan: Plan | None, budget_bytes: int) -> tuple[tuple[int, ...], ...]:
    """The headroom per point the guard keeps while ``plan`` is replayed under ``budget_bytes``.

    Only for a plan that fills the budget, where the largest rise cannot be left free: a plan
    made under it keeps it everywhere, as its replays were proven with (empty: the one).
    """
    if plan is None or plan.budget_bytes + plan.reserve_bytes <= budget_bytes:
        return ()
    return plan.step_reserve_bytes
