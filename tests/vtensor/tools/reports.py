"""Synthetic iteration reports and a trace for the tools' tests (no model runs)."""

import dataclasses

from vtensor.activations.report import IterationReport, StepStats
from vtensor.planner.trace import Phase, Trace, TraceStep, TraceTensor

MIB = 2**20


def report(
    peaks_mib: list[float], moved_mib: list[float], source: str, **changes: object
) -> IterationReport:
    """An iteration of eight steps with these peaks and evictions (MiB); ``changes`` replaced."""
    phases = [Phase.OTHER] + [Phase.FORWARD] * 3 + [Phase.BACKWARD] * 3 + [Phase.OTHER]
    steps = tuple(
        StepStats(i, f"{p.value}:{i}", p, 0.01, int(m * MIB), int(o * MIB), 0, 0.0, 0.0)
        for i, (p, m, o) in enumerate(zip(phases, peaks_mib, moved_mib, strict=True))
    )
    top = max(s.peak_device_bytes for s in steps)
    made = IterationReport(
        0,
        "planned",
        "chunk",
        source,
        "cpu",
        6 * MIB,
        MIB,
        top,
        None,
        "rss-vmhwm",
        top,
        sum(s.bytes_out for s in steps),
        0,
        0.0,
        0.0,
        0.1,
        steps,
    )
    return dataclasses.replace(made, **changes)  # type: ignore[arg-type]


def lean(full: IterationReport, iteration: int, **changes: object) -> IterationReport:
    """``full`` replayed lean: no per-step statistics, its peak the highest boundary reading."""
    return dataclasses.replace(full, iteration=iteration, steps=(), lean=True, **changes)  # type: ignore[arg-type]


def trace() -> Trace:
    """Eight steps, one 4 MiB tensor saved at step 1 and used at step 6."""
    unmanaged_mib = [1, 1, 1, 3, 3, 1, 1, 1]
    steps = tuple(
        TraceStep(i, f"s{i}", Phase.FORWARD if i < 4 else Phase.BACKWARD, 0.01, 0, 0, u * MIB)
        for i, u in enumerate(unmanaged_mib)
    )
    tensors = (TraceTensor(0, 4 * MIB, ("float32",), 1, 2, (6,)),)
    return Trace(steps, tensors, 0, MIB, 2**40, MIB, "cpu")
