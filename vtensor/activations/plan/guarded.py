"""The plan of a profiled trace that leaves the guard its headroom."""

import dataclasses
import logging

from vtensor.errors import InfeasibleBudgetError
from vtensor.planner.belady import plan_lgm
from vtensor.planner.costs import DEFAULT_COSTS, Costs
from vtensor.planner.memory_model import step_headroom, watched_events, watched_steps
from vtensor.planner.plan import Plan
from vtensor.planner.reserves import MIN_BUDGET_MARGIN_BYTES, planned_headroom, step_reserves
from vtensor.planner.trace import Trace

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
    """The plan of ``trace`` under ``budget_bytes`` that leaves the guard its headroom; None: none.

    NOTE [plan within the guard]: the plan leaves the guard its headroom (NOTE [planned
    headroom]), so every byte moved is the plan's; where infeasible it fills the whole budget.
    ``margin_bytes`` more are left where a validating replay saw the guard act.

    NOTE [floor over the budget]: a step's modelled floor can exceed what it really needed (its
    unmanaged peak and its tensors' uses need not coincide). Where the stated minimum fits the
    budget, such steps are planned at their floor and the guard keeps the budget at run time;
    refusing would leave the much slower reactive policy. Such a plan never replays lean.
    """
    plan: Plan | None = None
    reserves = step_reserves(trace)
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
        # NOTE [floor over the budget]
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
    # NOTE [lean replay]: read where the plan comes within twice the guard's headroom (or a
    # tenth of the budget) of the budget, and predicts a chunk more than it last confirmed.
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
        encoded=trace.encoded,  # NOTE [mask encoding]
        step_reserve_bytes=step_reserves(trace),  # NOTE [step reserve]
    )
