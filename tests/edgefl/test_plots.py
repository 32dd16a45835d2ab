"""What the plots draw: clients stay apart, the training state line, sweep labels off the budget."""

from pathlib import Path
from typing import Any

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from edgefl.budget import Budget
from edgefl.history import ClientRound, RunHistory
from edgefl.plots import STATE_LABEL, draw_client_memory
from edgefl.settings import DeviceClass
from edgefl.sweep.plot import plot_sweep
from edgefl.sweep.summary import JobRow, JobState


def _row(server_round: int, node: int, partition: int, device_class: int) -> ClientRound:
    metrics = {
        "partition-id": float(partition),
        "device-class": float(device_class),
        "peak-device-bytes": float(5 << 20),  # every client peaks at the same bytes
        "budget-bytes": float(6 << 20),
    }
    return ClientRound(server_round, "train", node, metrics)


def test_clients_with_equal_peaks_stay_apart_by_marker_and_position() -> None:
    history = RunHistory()
    history.clients += [
        _row(r, node, pid, cls)
        for r in (1, 2)
        for node, pid, cls in ((7, 0, 0), (8, 1, 0), (9, 2, 1))
    ]
    classes = [DeviceClass("a", Budget(peak_fraction=0.5), 0.5), DeviceClass("b", Budget(1), 0.5)]
    fig, ax = plt.subplots()
    draw_client_memory(ax, history, classes, 10 << 20)
    clients = [line for line in ax.lines if str(line.get_label()).startswith("client")]
    assert len(clients) == 3
    xs = {tuple(line.get_xdata()) for line in clients}  # type: ignore[arg-type]
    assert len(xs) == 3  # no client is drawn exactly over another
    markers = {str(line.get_label()): line.get_marker() for line in clients}
    assert markers["client 0"] == markers["client 1"] != markers["client 2"]
    assert len(ax.collections) == 2  # one band per class
    plt.close(fig)


def test_client_memory_draws_the_training_state_with_a_legend_label() -> None:
    history = RunHistory()
    history.clients += [_row(1, 7, 0, 0), _row(1, 9, 1, 1)]
    classes = [DeviceClass("a", Budget(peak_fraction=0.5), 0.5), DeviceClass("b", Budget(1), 0.5)]
    fig, ax = plt.subplots()
    draw_client_memory(ax, history, classes, 10 << 20, state_bytes=8 << 20)
    label = f"{STATE_LABEL} (8.0 MiB)"
    (state,) = [line for line in ax.lines if line.get_label() == label]
    assert list(state.get_ydata()) == [8.0, 8.0]  # type: ignore[arg-type]  # MiB, horizontal
    legend = ax.get_legend()
    assert legend is not None and label in [t.get_text() for t in legend.get_texts()]
    plt.close(fig)


def test_client_memory_draws_no_training_state_line_unless_given() -> None:
    history = RunHistory()
    history.clients += [_row(1, 7, 0, 0)]
    fig, ax = plt.subplots()
    draw_client_memory(ax, history, [DeviceClass("a", Budget(1), 1.0)], 10 << 20)
    assert not any(str(line.get_label()).startswith(STATE_LABEL) for line in ax.lines)
    plt.close(fig)


def test_sweep_bar_labels_sit_inside_the_bars(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = [
        JobRow(str(i), (f"x={i}",), JobState.OK, "", True, 0.9, 0.3, 1, 1.0, f, 0, 1.0, "")
        for i, f in enumerate((0.97, 0.99))
    ]
    figures: list[Figure] = []
    real_savefig = Figure.savefig

    def keep(fig: Figure, *args: Any, **kwargs: Any) -> None:
        figures.append(fig)
        real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    plot_sweep(rows, tmp_path / "s.png")
    labels = [t for t in figures[0].axes[2].texts if t.get_text().endswith("%")]
    assert [t.get_text() for t in labels] == ["97.0%", "99.0%"]
    assert all(t.get_position()[1] < 80 for t in labels)  # far below the budget line at 100
