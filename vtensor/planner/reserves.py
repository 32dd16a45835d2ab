"""The guard's headroom point by point: how far the bytes rose after it acted there (pure).

NOTE [step reserve]
Between two points where the guard can act (a step's start, a pack, an unpack) the tracked bytes
can rise where no hook can make room (an op's output, a concatenation and what consumes it, a
backward node's working set), so the guard keeps headroom under the budget while a plan is
replayed. One figure for the whole iteration would sit under the plan's own peak wherever one
step rises far more than the rest, and one per step would count a backward node's working set
again after the step's peak: either way the guard would evict at every replay. So the profile
books to each point where the guard acted (the step, and the point's place among its hook
events, the same in every iteration of one plan) how far the readings rose before the guard
could act again, less what the manager announced or did itself in between (parameter reads,
restores, recomputations: a replayed plan places those). ``TraceStep.growth_bytes`` holds them,
``Plan.step_reserve_bytes`` carries them. While a replay follows its plan the guard keeps at each
point what followed it in the profile (at least its one chunk); a lean replay guards at
boundaries only, with the headroom of the step's start (NOTE [lean replay]). A joint plan with
parameter offloading, and a replay that has left its plan, keep the largest rise everywhere.

NOTE [planned headroom]
A plan need not leave the rises free as well: the bytes a rise brings are already in the trace's
step model (what is still allocated at the next reading is in that step's unmanaged peak; a
tensor saved in between counts as the plan's from its step's start), so while a replay follows
its plan each point's reading and the rise after it stay within the prediction. Planning under
the largest rise at every step would move bytes for one step's rise at all of them. So the plan
leaves the guard its one chunk (the least it keeps at a point), or the largest rise where that is
less; where the guard keeps the largest rise everywhere (a joint plan, or no rises booked) it
leaves that. What the model misses (writes still in flight, NOTE [lean waits]; a step whose end
rises before the next one's evictions) shows as bytes the guard moves beyond the plan, and the
plan is made again that much lower (NOTE [guard margin]).

NOTE [gross rise]
The rise booked to a point counts everything the model allocated until the guard could act
again, even where evictions completed in between and the readings rose less. While profiling,
the guard's early evictions complete at the next point, before its reading: the readings rose
by the allocations less those writes. A replay's writes complete when the disk and the load let
them; one still in flight there rises by all the allocations, so the headroom booked net of
the writes would sit under what that replay needs.
"""

from vtensor.planner.trace import Trace

# The least headroom the guard keeps while a plan is followed, without chunks (its one chunk).
GUARD_MIN_BYTES = 64 * 1024


def step_reserves(trace: Trace) -> tuple[tuple[int, ...], ...]:
    """Per step of ``trace``, the rise after each hook event the guard acted at; empty if none."""
    reserves = tuple(s.growth_bytes for s in trace.steps)
    return reserves if any(reserves) else ()


def planned_headroom(
    reserves: tuple[tuple[int, ...], ...], reserve_bytes: int, chunk_bytes: int | None
) -> int:
    """What a plan leaves its guard free under the budget (NOTE [planned headroom]).

    ``reserves`` are the rises per point the guard keeps while the replay follows its plan
    (empty: it keeps ``reserve_bytes`` everywhere); ``chunk_bytes`` is the plan's chunk.
    """
    if not reserves:
        return reserve_bytes
    return min(chunk_bytes or GUARD_MIN_BYTES, reserve_bytes)
