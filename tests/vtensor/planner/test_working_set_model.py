"""A recomputed unit's working set in the model (NOTE [recomputation's working set])."""

import dataclasses

from vtensor.planner.lgm import build_lgm, min_budget
from vtensor.planner.recomputed import with_recompute
from vtensor.planner.trace import Phase, Trace, TraceStep, TraceTensor, TraceUnit

KB = 1000


def _trace(
    working: int,
    parts: tuple[int, ...] = (),
    last_part: int = -1,
    bases: tuple[int, ...] = (),
) -> Trace:
    """Unit m saves a (100 KB) in forward; its one backward step uses it (in ``last_part``)."""
    peak = max(parts, default=20 * KB)
    backward = TraceStep(
        1, "backward:m", Phase.BACKWARD, 0.01, 0, 0, peak, part_peak_bytes=parts,
        part_base_bytes=bases,
    )  # fmt: skip
    steps = (
        TraceStep(0, "forward:m", Phase.FORWARD, 0.01, 0, 0, 5 * KB),
        backward,
        TraceStep(2, "other:after-backward", Phase.OTHER, 0.01, 0, 0, 0),
    )
    tensors = (TraceTensor(0, 100 * KB, ("float32",), 0, 1, (1,), last_part=last_part),)
    unit = TraceUnit("m", 0, 0, 0.01, (0,), (), True, "", working_bytes=working)
    return Trace(steps, tensors, 0, 0, 0, None, "cpu", units=(unit,))


def _floor(trace: Trace) -> int:
    return min_budget(build_lgm(trace, None))[0]


def test_what_the_forward_held_beyond_its_saved_tensors_is_held_while_it_runs_again() -> None:
    plain = with_recompute(_trace(working=0), ["m"])
    # Its forward held 160 KB at once: the 100 KB it saved and 60 KB no op saved.
    held = with_recompute(_trace(working=160 * KB), ["m"])
    assert held.steps[1].unmanaged_peak_bytes == plain.steps[1].unmanaged_peak_bytes + 60 * KB
    assert _floor(held) == _floor(plain) + 60 * KB
    # The forward step is not where it runs again: unchanged there.
    assert held.steps[0] == plain.steps[0]


def test_a_working_set_no_larger_than_the_saved_tensors_adds_nothing() -> None:
    plain = with_recompute(_trace(working=0), ["m"])
    assert with_recompute(_trace(working=100 * KB), ["m"]).steps == plain.steps


def test_the_working_set_is_held_only_through_the_part_of_the_first_use() -> None:
    # The backward step's parts: the unit's tensor is last used in part 0, the peak is part 1's.
    parts = (20 * KB, 80 * KB)
    held = with_recompute(_trace(160 * KB, parts, last_part=0), ["m"])
    # Part 0: 20 KB + the 100 KB brought back + 60 KB still running; part 1: the 80 KB alone.
    assert held.steps[1].part_peak_bytes == (180 * KB, 80 * KB)
    assert held.steps[1].unmanaged_peak_bytes == 180 * KB
    # Used last in part 1, the forward may run again as late as part 1: held through it too.
    late = with_recompute(_trace(160 * KB, parts, last_part=1), ["m"])
    assert late.steps[1].part_peak_bytes == (20 * KB + 160 * KB, 80 * KB + 160 * KB)


def test_the_working_set_peaks_at_the_unpack_before_the_parts_own_work() -> None:
    # NOTE [working set at an unpack]: part 0 starts at 10 KB and its node takes it to 20 KB,
    # part 1 starts at 15 KB and peaks at 80 KB. Running again from a part's start, the unit
    # holds 60 KB beyond the 100 KB it brings back: at most 15 + 60 = 75 KB beside them, where
    # each part's own work, after it, peaks at 20 and 80 KB.
    parts, bases = (20 * KB, 80 * KB), (10 * KB, 15 * KB)
    held = with_recompute(_trace(160 * KB, parts, last_part=1, bases=bases), ["m"])
    assert held.steps[1].part_peak_bytes == (100 * KB + 75 * KB, 100 * KB + 80 * KB)
    # A part that starts at its peak holds the 60 KB on top of it, as without bases.
    top = with_recompute(_trace(160 * KB, parts, last_part=1, bases=parts), ["m"])
    plain = with_recompute(_trace(160 * KB, parts, last_part=1), ["m"])
    assert top.steps[1].part_peak_bytes == plain.steps[1].part_peak_bytes
    assert top.steps[1].part_peak_bytes == (100 * KB + 20 * KB + 60 * KB, 100 * KB + 140 * KB)
    # The bases survive JSON, and the state to come.
    trace = _trace(160 * KB, parts, last_part=1, bases=bases)
    assert Trace.from_json(trace.to_json()).steps[1].part_base_bytes == bases
    assert trace.holding(KB).steps[1].part_base_bytes == (11 * KB, 16 * KB)


def test_it_runs_again_at_the_first_use_of_what_it_saved() -> None:
    # m's own backward step (its residual, say) unpacks nothing; m.fc's uses a.
    steps = (
        TraceStep(0, "forward:m", Phase.FORWARD, 0.01, 0, 0, 5 * KB),
        TraceStep(1, "backward:m", Phase.BACKWARD, 0.01, 0, 0, 30 * KB),
        TraceStep(2, "backward:m.fc", Phase.BACKWARD, 0.01, 0, 0, 20 * KB),
        TraceStep(3, "other:after-backward", Phase.OTHER, 0.01, 0, 0, 0),
    )
    tensors = (TraceTensor(0, 100 * KB, ("float32",), 0, 1, (2,)),)
    unit = TraceUnit("m", 0, 0, 0.01, (0,), (), True, "", working_bytes=160 * KB)
    trace = Trace(steps, tensors, 0, 0, 0, None, "cpu", units=(unit,))
    alone = dataclasses.replace(unit, working_bytes=0)
    plain = with_recompute(dataclasses.replace(trace, units=(alone,)), ["m"])
    held = with_recompute(trace, ["m"])
    assert held.steps[1].unmanaged_peak_bytes == plain.steps[1].unmanaged_peak_bytes
    assert held.steps[2].unmanaged_peak_bytes == plain.steps[2].unmanaged_peak_bytes + 60 * KB


def test_a_unit_left_alone_keeps_its_step_and_the_working_set_survives_json() -> None:
    trace = _trace(working=160 * KB)
    assert with_recompute(trace, []).steps == trace.steps
    assert Trace.from_json(trace.to_json()).units[0].working_bytes == 160 * KB
