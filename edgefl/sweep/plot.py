"""The sweep summary plot: accuracy per round, round time, peak memory against budget per job."""

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from edgefl.sweep.summary import JobRow, JobState

SUMMARY_PNG = "sweep_summary.png"


def plot_sweep(rows: Sequence[JobRow], path: Path) -> Path:
    """Three panels, one colour per job; jobs without results are marked in the memory panel."""
    fig, (ax_acc, ax_time, ax_mem) = plt.subplots(1, 3, figsize=(15, 4.5))
    colours = plt.get_cmap("tab10")
    labels = job_labels(rows)
    for index, (row, label) in enumerate(zip(rows, labels, strict=True)):
        colour = colours(index % 10)
        if row.central_acc:
            ax_acc.plot(*zip(*row.central_acc, strict=True), "o-", color=colour, label=label)
        if row.round_wall_s:
            ax_time.plot(*zip(*row.round_wall_s, strict=True), "o-", color=colour, label=label)
        if row.max_peak_fraction is not None:
            bars = ax_mem.bar(index, 100 * row.max_peak_fraction, color=colour)
            # inside the bar: at its top the label would sit on the budget line at 100 %
            ax_mem.bar_label(bars, fmt="%.1f%%", fontsize=8, label_type="center", color="white")
        else:
            text = "no memory figures" if row.status is JobState.OK else str(row.status)
            ax_mem.text(index, 2, text, ha="center", va="bottom", rotation=90, color="tab:red")
    last_round = max((r.rounds for r in rows), default=1)
    names = sorted({r.accuracy for r in rows})  # what each job's accuracy counts
    accuracy = names[0] if len(names) == 1 else " or ".join(names)
    ax_acc.set(xlabel="round", ylabel=accuracy, title=f"central {accuracy} per round")
    ax_acc.set_xlim(-0.5, last_round + 0.5)
    ax_time.set(xlabel="round", ylabel="seconds", title="round wall time")
    ax_time.set_xlim(0.5, max(last_round, 1) + 0.5)
    ax_time.set_ylim(bottom=0)
    ax_mem.axhline(100, ls="--", color="black", label="budget")
    ax_mem.set(ylabel="% of budget", title="max client peak device memory / budget")
    ax_mem.set_xticks(range(len(rows)), [lb.replace(" ", "\n") for lb in labels], fontsize=7)
    ax_mem.set_xlim(-0.75, max(len(rows), 1) - 0.25)
    fractions = [r.max_peak_fraction for r in rows if r.max_peak_fraction is not None]
    ax_mem.set_ylim(0, max([115.0, *(100 * f + 10 for f in fractions)]))
    for ax in (ax_acc, ax_time):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        if ax.lines:
            ax.legend(fontsize=7)
    for ax in (ax_acc, ax_time, ax_mem):
        ax.grid(alpha=0.3)
    ax_mem.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def job_labels(rows: Sequence[JobRow]) -> list[str]:
    """``#<job> <overrides>``, leaving out the overrides every job shares.

    "(check)" marks a job that is not comparable (NOTE [checks, not results] in
    edgefl.sweep.summary).
    """
    shared = set.intersection(*(set(r.overrides) for r in rows)) if len(rows) > 1 else set()
    labels = []
    for r in rows:
        words = [f"#{r.job}", *(o for o in r.overrides if o not in shared)]
        labels.append(" ".join(words if r.comparable else [*words, "(check)"]))
    return labels
