"""The memory model of a backward step's parts (NOTE [backward parts] in memory_model.py)."""

from vtensor.planner.lgm import build_lgm, empty_plan, min_budget
from vtensor.planner.memory_model import simulate, step_unmanaged
from vtensor.planner.recomputed import with_recompute
from vtensor.planner.trace import Phase, Trace, TraceStep, TraceTensor, TraceUnit

KB = 1000


def _trace(parts: tuple[int, ...], last_parts: tuple[int, int]) -> Trace:
    """Forward saves a (100 KB) and b (10 KB); one backward step of ``parts`` uses both.

    a is last unpacked in part ``last_parts[0]``, b in ``last_parts[1]``.
    """
    steps = (
        TraceStep(0, "forward:m", Phase.FORWARD, 0.01, 0, 0, 5 * KB),
        TraceStep(1, "backward:m", Phase.BACKWARD, 0.01, 0, 0, max(parts), part_peak_bytes=parts),
        TraceStep(2, "other:after-backward", Phase.OTHER, 0.01, 0, 0, 0),
    )
    tensors = (
        TraceTensor(0, 100 * KB, ("float32",), 0, 1, (1,), last_part=last_parts[0]),
        TraceTensor(1, 10 * KB, ("float32",), 0, 1, (1,), last_part=last_parts[1]),
    )
    unit = TraceUnit("m", 0, 0, 0.01, (0, 1), (), True, "")
    return Trace(steps, tensors, 0, 0, 0, None, "cpu", units=(unit,))


def _peak(trace: Trace) -> int:
    return max(simulate(empty_plan(trace, 0, None), trace))


def test_a_tensor_done_with_before_the_step_peaks_is_not_counted_there() -> None:
    # a is used in part 0; the step's working set peaks in part 1 (80 KB), where only b is held.
    trace = _trace((20 * KB, 80 * KB), (0, 1))
    # Part 0 holds both (20 + 110 KB), part 1 only b (80 + 10 KB): 130 KB, less the 110 KB used.
    assert step_unmanaged(trace)[1] == 20 * KB
    assert _peak(trace) == 130 * KB
    assert min_budget(build_lgm(trace, None))[0] == 130 * KB
    coarse = _trace((20 * KB, 80 * KB), (-1, -1))
    assert _peak(coarse) == 190 * KB  # the step's peak with both tensors on top


def test_the_refined_figure_never_exceeds_the_step_figure() -> None:
    # Both used to the end: parts change nothing.
    trace = _trace((20 * KB, 80 * KB), (1, 1))
    assert step_unmanaged(trace)[1] == 80 * KB
    assert _peak(trace) == 190 * KB


def test_recomputed_bytes_leave_after_the_part_that_used_them_last() -> None:
    trace = _trace((20 * KB, 80 * KB), (0, 1))
    recomputed = with_recompute(trace, ["m"])
    assert not recomputed.tensors
    step = recomputed.steps[1]
    assert step.part_peak_bytes == (20 * KB + 110 * KB, 80 * KB + 10 * KB)
    assert step.unmanaged_peak_bytes == 130 * KB
    assert _peak(recomputed) == 130 * KB
    whole = with_recompute(_trace((20 * KB, 80 * KB), (-1, -1)), ["m"])
    assert _peak(whole) == 190 * KB


def test_parts_survive_a_json_round_trip_and_the_state_to_come() -> None:
    trace = _trace((20 * KB, 80 * KB), (0, 1))
    assert type(trace).from_json(trace.to_json()) == trace
    held = trace.holding(7 * KB)
    assert held.steps[1].part_peak_bytes == (27 * KB, 87 * KB)
    assert held.steps[1].unmanaged_peak_bytes == 87 * KB
