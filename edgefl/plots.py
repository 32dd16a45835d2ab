"""PNG plots of a run with matplotlib's headless Agg backend."""

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from edgefl.history import RunHistory, class_names, class_of
from edgefl.records import BUDGET_BYTES, PARTITION_ID, PEAK_DEVICE_BYTES
from edgefl.settings import DeviceClass

ACCURACY_PNG = "accuracy_loss.png"
MEMORY_PNG = "client_memory.png"
_MIB = float(1 << 20)
STATE_LABEL = "parameters+gradients+optimizer state"


def plot_accuracy_loss(history: RunHistory, path: Path, accuracy: str = "accuracy") -> Path:
    """Central ``accuracy`` (its name) and loss (and clients' mean train loss) per round."""
    rounds = [r for r in history.rounds if r.central_acc is not None]
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(10, 4))
    ax_acc.plot([r.server_round for r in rounds], [r.central_acc for r in rounds], "o-")
    ax_acc.set(xlabel="round", ylabel=accuracy, title=f"central {accuracy} (held-out test set)")
    ax_loss.plot(
        [r.server_round for r in rounds],
        [r.central_loss for r in rounds],
        "o-",
        label="central test loss",
    )
    trained = [r for r in history.rounds if r.train_loss is not None]
    ax_loss.plot(
        [r.server_round for r in trained],
        [r.train_loss for r in trained],
        "s--",
        label="clients' train loss",
    )
    ax_loss.set(xlabel="round", ylabel="loss", title="loss")
    ax_loss.legend()
    for ax in (ax_acc, ax_loss):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _save(fig, path)


def plot_client_memory(
    history: RunHistory,
    classes: Sequence[DeviceClass],
    unmanaged_peak_bytes: int | None,
    path: Path,
    state_bytes: int | None = None,
) -> Path:
    """Each client's peak device memory per round, by device class, against budgets.

    ``state_bytes``: the model's parameters + gradients + optimizer state, drawn as a line
    (``draw_client_memory``); None or 0 draws none.
    """
    fig, ax = plt.subplots(figsize=(9, 4.5))
    draw_client_memory(ax, history, classes, unmanaged_peak_bytes, state_bytes)
    return _save(fig, path)


_MARKERS = "os^Dv<>PX*"
_SPREAD = 0.08  # rounds between neighbouring clients of one class, so none hides another


def draw_client_memory(
    ax: Axes,
    history: RunHistory,
    classes: Sequence[DeviceClass],
    unmanaged_peak_bytes: int | None,
    state_bytes: int | None = None,
) -> None:
    """Draw ``plot_client_memory``'s panel on ``ax``.

    Clients of one class often peak at the same bytes: each class has its own marker and a band
    from its lowest to its highest client per round, and its clients sit side by side around
    the round's x position. The training state line (``state_bytes``) shows which budgets lie
    below it: no batch size, micro-batching or checkpointing trains the model there unmanaged.
    """
    colours = plt.get_cmap("tab10")
    rows = [c for c in history.clients if c.phase == "train" and c.error is None]
    fleet = [device.name for device in classes]
    partition_of = {c.node_id: c.metrics[PARTITION_ID] for c in rows}
    node_class = {c.node_id: class_of(c, fleet) for c in rows}
    nodes = sorted(partition_of, key=partition_of.__getitem__)
    names = class_names(rows, fleet)
    for index, name in enumerate(names):
        members = [n for n in nodes if node_class[n] == name]
        if not members:
            continue
        colour, marker = colours(index % 10), _MARKERS[index % len(_MARKERS)]
        for rank, node in enumerate(members):
            mine = sorted((c for c in rows if c.node_id == node), key=lambda c: c.server_round)
            shift = (rank - (len(members) - 1) / 2) * _SPREAD
            ax.plot(
                [c.server_round + shift for c in mine],
                [c.metrics[PEAK_DEVICE_BYTES] / _MIB for c in mine],
                marker=marker,
                ls="-",
                alpha=0.8,
                color=colour,
                label=f"client {int(mine[0].metrics[PARTITION_ID])}",
            )
        by_round: dict[int, list[float]] = {}
        for c in rows:
            if node_class[c.node_id] == name:
                by_round.setdefault(c.server_round, []).append(c.metrics[PEAK_DEVICE_BYTES] / _MIB)
        rounds = sorted(by_round)
        ax.fill_between(
            rounds,
            [min(by_round[r]) for r in rounds],
            [max(by_round[r]) for r in rounds],
            color=colour,
            alpha=0.15,
            lw=0,
        )
    for index, name in enumerate(names):  # budgets as the clients resolved them
        budgets = [c.metrics[BUDGET_BYTES] for c in rows if node_class[c.node_id] == name]
        if budgets:
            ax.axhline(
                max(budgets) / _MIB, ls="--", color=colours(index % 10), label=f"budget {name}"
            )
    if unmanaged_peak_bytes:
        ax.axhline(unmanaged_peak_bytes / _MIB, ls=":", color="black", label="unmanaged peak")
    if state_bytes:
        mib = state_bytes / _MIB  # its value in the label: the line may lie under the peak's
        ax.axhline(mib, ls="-.", lw=2, color="dimgrey", label=f"{STATE_LABEL} ({mib:.1f} MiB)")
    ax.set(xlabel="round", ylabel="MiB", title="per-client peak device memory vs budget")
    ax.set_ylim(bottom=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
