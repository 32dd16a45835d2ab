"""The guard's headroom point by point: how far the bytes rose after it acted there (pure).

NOTE [step reserve]
Between two points where the guard can act (a step's start, a pack, an unpack) the bytes rise
where no hook can make room; one headroom for the whole iteration would sit under the plan's peak
and the guard would evict at every replay. So the profile books per step and hook event how far
the bytes rose after the guard acted there, less the manager's own restores and recomputations
(``TraceStep.growth_bytes``, ``Plan.step_reserve_bytes``), and a replay following its plan keeps
that (at least a chunk). Diverged replays keep the largest. A joint replay's write-backs hold their
bytes until done, so it waits for them where they exceed the step's predicted headroom.

NOTE [planned headroom]
The rises are in the trace's step model already, and planning under the largest at every step
would move bytes for one step's rise at all of them. So a plan leaves the guard one chunk (the
largest rise, where less), or the largest rise where the guard keeps it everywhere; what the model
misses, the validating replay corrects (NOTE [one decision]).

NOTE [gross rise]
The rise booked to a point counts everything allocated until the guard could act again, even
where evictions completed in between: a replay's writes complete when the disk lets them, so
headroom booked net of them would be too small.
"""

from vtensor.planner.trace import Trace

# What a stated minimum adds for the counter's noise (small allocations beside the tensors), and
# the least a planned headroom leaves.
MIN_BUDGET_MARGIN_BYTES = 64 * 1024

# The least headroom the guard keeps while a plan is followed, without chunks (its one chunk).
GUARD_MIN_BYTES = 64 * 1024


def step_reserves(trace: Trace) -> tuple[tuple[int, ...], ...]:
    """Per step of ``trace``, the rise after each hook event the guard acted at; empty if none."""
    reserves = tuple(s.growth_bytes for s in trace.steps)
    return reserves if any(reserves) else ()


def planned_headroom(
    reserves: tuple[tuple[int, ...], ...], reserve_bytes: int, chunk_bytes: int | None
) -> int:
    """What a plan leaves its guard free under the budget (NOTE [planned headroom])."""
    if not reserves:
        return reserve_bytes
    return min(chunk_bytes or GUARD_MIN_BYTES, reserve_bytes)
