"""Planning again under a margin when a replay needed the guard (NOTE [guard margin])."""

import dataclasses
import logging
from collections.abc import Callable

from vtensor.planner.plan import Plan
from vtensor.planner.recompute import predicted_step_s
from vtensor.planner.trace import Trace

logger = logging.getLogger(__name__)

Profile = tuple[Trace, int, int]  # a profiled trace, its guard's reserve, its minimum budget
Planner = Callable[..., Plan | None]  # (trace, reserve, minimum budget, margin_bytes=) -> plan


def plan_again(make_plan: Planner, profile: Profile, plan: Plan, guard_bytes: int) -> Plan | None:
    """``plan`` made again from ``profile``, ``guard_bytes`` further under the budget.

    None where no plan fits lower. ``make_plan`` is the plan book's planner.

    NOTE [guard margin]
    A plan made to the guard's high watermark (NOTE [plan within the guard] in
    ``activations/guarded_plan.py``) leaves no room for the difference between the planner's model
    (bytes per step, an eviction gone from its step on) and the readings of a real replay, so
    the guard evicts at the hook points where a reading comes out higher, and, having cut a
    victim once, takes its remainder whole (NOTE [guard takes whole remainders]): on
    MobileNetV2 at 50 % every full replay moved bytes beyond the plan, and no replay could go
    lean (NOTE [lean replay]). So the first full replay that needed the guard has the plan made
    again from the profile it was made from (a hybrid plan's from its trial, with the same
    recomputation), leaving the bytes the guard moved free as well; if that plan still needs
    the guard it is kept all the same (once per decision, so plans cannot drift down). Plans
    from the cache come from another process's profile: they stay as they are.
    """
    trace, reserve_bytes, min_budget_bytes = profile
    replanned = make_plan(trace, reserve_bytes, min_budget_bytes, margin_bytes=guard_bytes)
    if replanned is None or replanned.budget_bytes >= plan.budget_bytes:
        return None
    logger.info(
        "the guard moved %d bytes beyond the plan: planned again %d bytes further under the budget",
        guard_bytes,
        plan.budget_bytes - replanned.budget_bytes,
    )
    return dataclasses.replace(
        replanned,
        recompute=plan.recompute,
        selective=plan.selective,
        one_node=plan.one_node,
        predicted_step_s=predicted_step_s(trace, replanned),
    )


def remake(
    candidates: list[tuple[Plan, Profile]], plan: Plan, make_plan: Planner, guard_bytes: int
) -> Plan | None:
    """A racing candidate made again under the guard's margin, once (NOTE [guard margin]).

    ``candidates`` pairs each candidate not yet made again with its profile; ``plan``'s pair is
    used up here. None if ``plan`` has none (made again already) or no plan fits lower.
    """
    index = next((i for i, (p, _) in enumerate(candidates) if p is plan), None)
    if index is None:
        return None
    _, profile = candidates.pop(index)
    return plan_again(make_plan, profile, plan, guard_bytes)
