"""Small traces of units for the planner's recomputation tests: one step per unit each way."""

from vtensor.planner.lgm import empty_plan
from vtensor.planner.memory_model import simulate
from vtensor.planner.trace import Phase, Trace, TraceStep, TraceTensor, TraceUnit

KB = 1000


Unit = tuple[str, float, int, bool]


def unit_trace(units: list[Unit], unmanaged: int = 0) -> Trace:
    """Forward over units in order, backward in reverse; each unit saves an input and inner.

    ``units``: (name, forward_s, inner bytes, safe). Unit i's tensors (its input: 1 KB) are
    saved at forward step i and used at its backward step.
    """
    n = len(units)
    names = [f"forward:{u[0]}" for u in units] + [f"backward:{u[0]}" for u in reversed(units)]
    steps = tuple(
        TraceStep(i, name, Phase(name.split(":")[0]), 0.01, 0, 0, unmanaged)
        for i, name in enumerate(names)
    )
    tensors: list[TraceTensor] = []
    trace_units = []
    for i, (name, forward_s, nbytes, safe) in enumerate(units):
        back, vid = 2 * n - 1 - i, len(tensors)
        tensors += [
            TraceTensor(vid + k, size, ("float32",), i, i + 1, (back,))
            for k, size in enumerate((KB, nbytes))
        ]
        unit = TraceUnit(name, i, i, forward_s, (vid + 1,), (vid,), safe, "" if safe else "x")
        trace_units.append(unit)
    return Trace(steps, tuple(tensors), 0, 0, 0, None, "cpu", units=tuple(trace_units))


def demand(trace: Trace) -> int:
    """The peak of ``trace`` with nothing moved: what a budget below it must save."""
    return max(simulate(empty_plan(trace, 0, None), trace))
