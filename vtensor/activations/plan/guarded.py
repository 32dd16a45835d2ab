"""The plan of a profiled trace that leaves the guard its headroom."""

import dataclasses
import logging

from vtensor.activations.runtime.floor import MIN_BUDGET_MARGIN_BYTES
from vtensor.errors import InfeasibleBudgetError
from vtensor.planner.belady import plan_lgm
from vtensor.planner.costs import DEFAULT_COSTS, Costs
from vtensor.planner.memory_model import step_headroom, watched_events, watched_steps
from vtensor.planner.plan import Plan
from vtensor.planner.reserves import planned_headroom, step_reserves
from vtensor.planner.trace import TensorKind, Trace

logger = logging.getLogger(__name__)


def plan_within_guard(
    trace: Trace,
    budget_bytes: int,
    chunk_bytes: int | None,
    reserve_bytes: int,
    min_budget_bytes: int,
    margin_bytes: int = 0,
    *,
    costs: Costs = DEFAULT_COSTS,
) -> Plan | None:
    """The plan of ``trace`` under ``budget_bytes`` that leaves the guard its headroom.

    None if there is none. ``min_budget_bytes`` (the profiled iteration's stated minimum) and
    ``reserve_bytes`` travel with the plan.

    NOTE [plan within the guard]: the plan leaves the guard its headroom free (its one chunk
    where the guard keeps each point's own rise; ``reserve_bytes``, the largest growth between
    two hook points, where it keeps that everywhere: NOTE [planned headroom] in
    ``planner/reserves.py``), so that the guard moves no bytes of its own and the bytes an
    iteration moves are the plan's. Where that is infeasible the plan fills the whole budget and
    the guard keeps its headroom as it can. ``margin_bytes`` more are left free first where a
    replay showed the guard still had to act (NOTE [one decision] in ``planning.py``).

    NOTE [floor over the budget]
    The trace's floor of a step (its largest unmanaged bytes, plus every tensor the step uses)
    can lie above what the step really needed: the step's unmanaged peak and its tensors' uses
    need not coincide. On the char GPT at 40 % of its peak the model's floor, the backward of
    the first attention's projection with the momentum, was 97.6 MiB (93.7 MiB with backward
    steps in parts, NOTE [backward parts] in ``planner/memory_model.py``), where the iteration
    stated 90.4 MiB and ran within the 93.4 MiB budget. Where the iteration's stated minimum
    fits the budget, such steps are planned at their floor and the rest at the budget, and the
    guard keeps the budget at runtime; a plan over the budget is never replayed lean. Refused
    instead, the manager ran reactively at 1.48x the unmanaged step.
    """
    plan: Plan | None = None
    joint = any(t.kind is not TensorKind.ACTIVATION for t in trace.tensors)
    reserves = () if joint else step_reserves(trace)
    under_guard = max(0, budget_bytes - planned_headroom(reserves, reserve_bytes, chunk_bytes))
    margined = max(0, under_guard - margin_bytes)
    for planned_bytes in dict.fromkeys((margined, under_guard, budget_bytes)):
        try:
            plan = plan_lgm(
                trace,
                planned_bytes,
                chunk_bytes=chunk_bytes,
                write_bytes_per_s=costs.write_bytes_per_s,
                read_bytes_per_s=costs.read_bytes_per_s,
            )
            break
        except InfeasibleBudgetError as err:
            if planned_bytes == budget_bytes and min_budget_bytes > budget_bytes:
                logger.warning("no swap plan at this budget, staying reactive: %s", err)
    if plan is None and min_budget_bytes <= budget_bytes:
        # NOTE [floor over the budget]: the iteration ran within the budget, the trace's model
        # of its floor does not; the guard keeps the budget where the plan does not.
        plan = plan_lgm(
            trace,
            budget_bytes,
            chunk_bytes=chunk_bytes,
            floors_over=True,
            write_bytes_per_s=costs.write_bytes_per_s,
            read_bytes_per_s=costs.read_bytes_per_s,
        )
    if plan is None:
        return None
    # NOTE [lean replay]: a replay reads the tracked bytes where the plan comes within the
    # guard's headroom twice over, or a tenth of the budget, of the budget; of those steps,
    # where the plan predicts a chunk more than it last confirmed (NOTE [confirmed readings]).
    margin = max(2 * reserve_bytes, budget_bytes // 10)
    slack = chunk_bytes or MIN_BUDGET_MARGIN_BYTES
    watched = watched_steps(plan, trace, margin, slack)
    return dataclasses.replace(
        plan,
        reserve_bytes=reserve_bytes,
        min_budget_bytes=min_budget_bytes,
        watched_steps=watched,
        step_headroom_bytes=step_headroom(plan, trace),  # NOTE [lean waits]
        watched_events=watched_events(plan, trace, watched),  # NOTE [hookless replay]
        encoded=trace.encoded,  # NOTE [encoding decided]
        step_reserve_bytes=step_reserves(trace),  # NOTE [step reserve]
    )
