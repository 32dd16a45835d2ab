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
everywhere. Every plan keeps the headroom per point: MobileNetV2's swap plan at 40 % of its
peak then replays lean (44 heap readings a step instead of 1055; benchmarks/HISTORY.md,
``activation_swap``, 2026-12-03). What once broke the budget with it, beside a busy loop, was no
rise but a plan's restores landing on a step the heap's noise had filled (NOTE [room for
restores] in ``activations/executor.py``).

NOTE [planned headroom]
A plan need not leave the rises free as well: the bytes a point's rise brings are in the
readings the trace's step model already holds (what is still allocated at the next reading is
in that step's unmanaged peak; a tensor saved in between counts as the plan's from the start of
its step), so where a replay follows its plan, each point's reading and the rise after it stay
within what the plan predicts. The plan leaves the guard its one chunk instead (the least it
keeps at a point), where the guard keeps each point's own rise, or the largest rise where that is
less (what plans left before); under a joint plan with parameter offloading, or without rises
booked, where the guard keeps the largest rise everywhere, it leaves that. What the model misses
(writes still in flight, which the replay waits for, NOTE [lean waits]; a step whose end rises
before the next one's evictions) shows as bytes the guard moves beyond the plan, and the plan is
made again that much lower (NOTE [guard margin]). Made under the largest rise at every step, a
plan moved for one step's rise at all of them: the char GPT at 60 % of its peak moved 261 MiB a
step planned 32 MiB under its budget, 197 MiB within a chunk of it (tracked peak 98.6 % of the
budget), MobileNetV2 at 50 % 185 against 150 MiB (``activation_swap`` in benchmarks/README.md);
the small DenseNet at 60 %, 11.9 against 8.2 MB, neither needing the guard
(``test_step_reserve.py``).

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
