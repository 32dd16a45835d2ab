"""Plot of device bytes and swap traffic per step of managed iterations, written as a PNG.

A lean replay keeps no per-step statistics: its line is its peak, flat. matplotlib is imported
only to draw, so the rest of vtensor does not need it.
"""

from collections.abc import Mapping, Sequence
from os import PathLike
from pathlib import Path
from typing import Any

from vtensor.activations.report import IterationReport
from vtensor.planner.memory_model import simulate
from vtensor.planner.plan import Plan
from vtensor.planner.trace import Phase, Trace

_MIB = float(2**20)
_PHASE_COLOURS = {Phase.FORWARD: "#e8f1fb", Phase.BACKWARD: "#fbeee6", Phase.OTHER: "#eeeeee"}


def phase_spans(phases: Sequence[Phase]) -> list[tuple[Phase, int, int]]:
    """Maximal runs of one phase as ``(phase, first step, last step)``, in order."""
    spans: list[tuple[Phase, int, int]] = []
    for index, phase in enumerate(phases):
        if spans and spans[-1][0] is phase:
            spans[-1] = (phase, spans[-1][1], index)
        else:
            spans.append((phase, index, index))
    return spans


def plot_timeline(
    runs: Mapping[str, IterationReport],
    budget_bytes: int,
    path: str | PathLike[str],
    *,
    trace: Trace | None = None,
    plan: Plan | None = None,
    title: str | None = None,
) -> Path:
    """Write a PNG of device bytes per step for each run, with the budget and swap traffic.

    Args:
        runs: label -> report of one iteration; each becomes a line.
        budget_bytes: drawn as a horizontal line.
        path: where the PNG goes (parent directories are created).
        trace: the profiled iteration the plan was made from.
        plan: its plan; with both, the predicted bytes per step are drawn dashed.
        title: figure title.

    Raises:
        ValueError: ``runs`` is empty.
    """
    if not runs:
        raise ValueError("plot_timeline needs at least one run to draw")
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window, work without a display
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(
        2, 1, sharex=True, figsize=(11, 6.5), gridspec_kw={"height_ratios": (3, 1.3)}
    )
    try:
        stepped = next((r.steps for r in runs.values() if r.steps), ())
        phases = [s.phase for s in stepped]
        if not phases and trace is not None:
            phases = [s.phase for s in trace.steps]
        _shade_phases(top, bottom, phases)
        _draw_memory(top, runs, budget_bytes, trace, plan)
        _draw_traffic(bottom, runs)
        if title:
            top.set_title(title)
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110, format="png")
    finally:
        plt.close(fig)
    return out


def _shade_phases(top: Any, bottom: Any, phases: Sequence[Phase]) -> None:
    for phase, first, last in phase_spans(phases):
        for axis in (top, bottom):
            axis.axvspan(first - 0.5, last + 0.5, color=_PHASE_COLOURS[phase], zorder=0, lw=0)
        top.text(
            (first + last) / 2,
            0.98,
            phase.value,
            transform=top.get_xaxis_transform(),
            ha="center",
            va="top",
            fontsize=8,
            color="#555555",
        )


def memory_line(report: IterationReport, last_step: int) -> tuple[list[int], list[float]]:
    """Step indices and device MiB of ``report``; a lean one's peak from step 0 to ``last_step``."""
    if not report.steps:
        return [0, last_step], [report.peak_device_bytes / _MIB] * 2
    return [s.index for s in report.steps], [s.peak_device_bytes / _MIB for s in report.steps]


def _draw_memory(
    axis: Any,
    runs: Mapping[str, IterationReport],
    budget_bytes: int,
    trace: Trace | None,
    plan: Plan | None,
) -> None:
    last_step = max((len(r.steps) for r in runs.values()), default=0) - 1
    if trace is not None:
        last_step = max(last_step, len(trace.steps) - 1)
    for label, report in runs.items():
        xs, ys = memory_line(report, max(last_step, 0))
        style = "steps-mid" if report.steps else "default"
        axis.plot(xs, ys, drawstyle=style, lw=1.4, ls="-" if report.steps else ":", label=label)
    if trace is not None and plan is not None and len(plan.step_names) == len(trace.steps):
        predicted = [b / _MIB for b in simulate(plan, trace)]
        axis.plot(
            [s.index for s in trace.steps],
            predicted,
            ls="--",
            drawstyle="steps-mid",
            color="black",
            lw=1.0,
            label="planner's prediction",
        )
    axis.axhline(
        budget_bytes / _MIB, color="red", lw=1.2, label=f"budget {budget_bytes / _MIB:.1f} MiB"
    )
    axis.set_ylabel("device MiB (peak per step)")
    axis.set_ylim(bottom=0)
    axis.legend(loc="upper left", fontsize=8, framealpha=0.9)


def _draw_traffic(axis: Any, runs: Mapping[str, IterationReport]) -> None:
    width = 0.8 / max(1, len(runs))
    for k, (label, report) in enumerate(runs.items()):
        xs = [s.index - 0.4 + width * (k + 0.5) for s in report.steps]
        out = [s.bytes_out / _MIB for s in report.steps]
        back = [-s.bytes_in / _MIB for s in report.steps]
        colour = f"C{k}"
        axis.bar(xs, out, width=width, color=colour, label=label)
        axis.bar(xs, back, width=width, color=colour, alpha=0.55)
    axis.axhline(0, color="black", lw=0.6)
    axis.set_ylabel("MiB out (+) / in (-)")
    axis.set_xlabel("step (module boundary) index")
