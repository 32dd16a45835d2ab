"""The memory timeline plot of python -m vtensor plan."""

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pytest

from tests.vtensor.tools.reports import MIB, lean, report, trace
from vtensor.planner.belady import plan_lgm
from vtensor.planner.trace import Phase
from vtensor.tools.timeline import phase_spans, plot_timeline

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_plot_timeline_writes_a_png_with_runs_budget_and_prediction(tmp_path: Path) -> None:
    runs = {
        "unmanaged": report([1, 2, 4, 6, 7, 5, 3, 1], [0] * 8, "profiled"),
        "planned": report([1, 2, 4, 5, 5, 5, 3, 1], [0, 0, 2, 0, 0, 0, 0, 0], "planned"),
    }
    planned_trace = trace()
    plan = plan_lgm(planned_trace, 6 * MIB)
    assert plan.moves
    path = plot_timeline(
        runs,
        6 * MIB,
        tmp_path / "a" / "t.png",
        trace=planned_trace,
        plan=plan,
        title="tiny, budget 6 MiB",
    )
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    with pytest.raises(ValueError, match="at least one run"):
        plot_timeline({}, 1, tmp_path / "empty.png")


def test_plot_timeline_draws_a_line_for_every_run_its_legend_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    figures: list[Any] = []
    close = plt.close
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at
    full = report([1, 2, 4, 5, 5, 5, 3, 1], [0, 0, 2, 0, 0, 0, 0, 0], "planned", iteration=1)
    runs = {
        "unmanaged": report([1, 2, 4, 6, 7, 5, 3, 1], [0] * 8, "profiled"),
        "iteration 1 (planned)": full,
        "iteration 2 (planned, lean)": lean(full, 2, peak_device_bytes=5 * MIB),
    }
    planned_trace = trace()
    plan = plan_lgm(planned_trace, 6 * MIB)
    plot_timeline(runs, 6 * MIB, tmp_path / "t.png", trace=planned_trace, plan=plan)
    top = figures[0].axes[0]
    try:
        drawn = {line.get_label(): line for line in top.get_lines()}
        named = [text.get_text() for text in top.get_legend().get_texts()]
        assert set(runs) <= set(named)
        for label in named:
            assert label in drawn and len(drawn[label].get_xdata()) > 0, label
        # A lean replay has no per-step statistics: its peak, across the iteration.
        flat = drawn["iteration 2 (planned, lean)"]
        assert set(flat.get_ydata()) == {5.0}
        assert (min(flat.get_xdata()), max(flat.get_xdata())) == (0, 7)
    finally:
        close(figures[0])


def test_phase_spans_groups_consecutive_phases() -> None:
    f, b, o = Phase.FORWARD, Phase.BACKWARD, Phase.OTHER
    assert phase_spans([o, f, f, b, b, b, o]) == [(o, 0, 0), (f, 1, 2), (b, 3, 5), (o, 6, 6)]
    assert phase_spans([]) == []
