"""Which modules to recompute instead of keeping or swapping what they save (pure).

NOTE [hybrid plan]
Every saved byte is kept, swapped or recomputed. Recomputing a unit (a module, NOTE [recompute]
in ``activations/recompute.py``) frees its inner tensors from its forward to its backward at the
price of its measured forward time and of its working set in backward: recomputation brings back
all of its inner tensors at once, at the start of its backward, where swapping would bring them
back one by one. The units cheapest per inner byte are taken first until they cover the deficit
(the peak over the budget), never two nested ones, and a unit is taken only if the iteration
with it recomputed (``with_recompute``: its inner tensors gone, their bytes held through its
backward steps, its inputs kept) still has a feasible floor; what remains is left to the swap
planner. No bandwidth model decides between the two: on a CPU the swap engine's work
(sealing, system calls, page faults on return) takes cores from compute even where the planner
hides the transfer, which a model of the disk alone does not see. So the choice is tested, not
trusted: the iteration after it is profiled with those units recomputed, its trace planned by
``plan_lgm``, and the plan with the smaller predicted step time (measured wall time of the
profiled steps, recomputation and the profiled iteration's own swapping included, plus the
predicted stall) is kept (``activations/planning.py``).
"""

import dataclasses
from collections.abc import Sequence

from vtensor.planner.lgm import build_lgm, empty_plan, min_budget
from vtensor.planner.memory_model import simulate
from vtensor.planner.plan import Plan
from vtensor.planner.trace import Trace, TraceUnit


def inner_bytes(trace: Trace, unit: TraceUnit) -> int:
    """Bytes recomputing ``unit`` would not keep."""
    return sum(trace.tensors[v].nbytes for v in unit.inner_vids)


def with_recompute(trace: Trace, names: Sequence[str]) -> Trace:
    """What ``trace`` would be with the units ``names`` recomputed (a model, for choosing).

    Their inner tensors are gone; their bytes are held, as unmanaged bytes, through every
    backward step of the unit (recomputation brings them all back at its start); their inputs
    cannot move (the checkpoint holds them). Vids are renumbered in order.
    """
    units = [u for u in trace.units if u.name in set(names)]
    gone = {v for u in units for v in u.inner_vids}
    kept = {v for u in units for v in u.input_vids}
    extra = [0] * len(trace.steps)
    for unit in units:
        held = inner_bytes(trace, unit)
        for step in trace.steps:
            if step.name == f"backward:{unit.name}" or step.name.startswith(
                f"backward:{unit.name}."
            ):
                extra[step.index] += held
    steps = tuple(
        dataclasses.replace(s, unmanaged_peak_bytes=s.unmanaged_peak_bytes + extra[s.index])
        for s in trace.steps
    )
    tensors = tuple(
        dataclasses.replace(t, vid=i, evictable_step=-1 if t.vid in kept else t.evictable_step)
        for i, t in enumerate(t for t in trace.tensors if t.vid not in gone)
    )
    return dataclasses.replace(trace, steps=steps, tensors=tensors, units=(), recomputed=())


def choose_recompute(trace: Trace, budget_bytes: int) -> tuple[str, ...]:
    """The units of ``trace`` to recompute at ``budget_bytes`` (sorted names; may be empty).

    Deterministic: ties are broken by name.
    """
    # What the iteration would hold if nothing moved (the profiled one already swapped).
    demand = simulate(empty_plan(trace, budget_bytes, trace.chunk_bytes), trace)
    deficit = max(demand, default=0) - budget_bytes
    if deficit <= 0:
        return ()
    sized = [(u, inner_bytes(trace, u)) for u in trace.units if u.safe]
    ranked = sorted(
        ((u, n) for u, n in sized if n > 0), key=lambda un: (un[0].forward_s / un[1], un[0].name)
    )
    chosen: list[str] = []
    freed = 0
    for unit, nbytes in ranked:
        if freed >= deficit:
            break
        if any(_nested(unit.name, other) for other in chosen):
            continue
        trial = with_recompute(trace, [*chosen, unit.name])
        if min_budget(build_lgm(trial, trace.chunk_bytes))[0] > budget_bytes:
            continue  # its working set in backward would not fit
        chosen.append(unit.name)
        freed += nbytes
    return tuple(sorted(chosen))


def predicted_step_s(trace: Trace, plan: Plan | None) -> float:
    """Measured compute of ``trace`` plus the stall ``plan`` predicts (inf without a plan)."""
    if plan is None:
        return float("inf")
    return sum(s.duration_s for s in trace.steps) + plan.predicted_stall_s


def _nested(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")
