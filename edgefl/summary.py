"""Human-readable text of a run: the line logged per round and the tables printed at the end."""

import re
from collections.abc import Sequence

import vtensor
from edgefl.history import ClientRound, RoundRecord, RunHistory, class_names, class_of
from edgefl.peak import PeakMeasurement
from edgefl.records import (
    BUDGET_BYTES,
    BYTES_SWAPPED_IN,
    BYTES_SWAPPED_OUT,
    EXAMPLES_PROCESSED,
    PEAK_DEVICE_BYTES,
    PLAN_SOURCE,
    TRAIN_CPU_S,
    TRAIN_S,
    plan_source_of,
)
from edgefl.reference import ReferenceRound
from edgefl.settings import DeviceClass
from vtensor import format_bytes


def round_line(record: RoundRecord, num_rounds: int, accuracy: str = "accuracy") -> str:
    """One line per round: central ``accuracy`` (its name) and loss, clients, memory, time."""
    central = (
        f"central {accuracy} -"
        if record.central_acc is None
        else f"central {accuracy} {record.central_acc:.4f} loss {record.central_loss:.4f}"
    )
    if record.server_round == 0:
        return f"round 0/{num_rounds} (initial model): {central}"
    peak = "-" if record.max_peak_fraction is None else f"{100 * record.max_peak_fraction:.0f}%"
    loss = "-" if record.train_loss is None else f"{record.train_loss:.4f}"
    privacy = "" if record.epsilon is None else f", epsilon {record.epsilon:.3g}"
    return (
        f"round {record.server_round}/{num_rounds}: {central} | clients trained "
        f"{record.clients_trained}, failed {record.clients_failed}, train loss {loss}, "
        f"max peak/budget {peak}, swapped {format_bytes(record.bytes_swapped)}, "
        f"stall {record.stall_s:.1f} s{privacy} | {record.wall_s:.1f} s"
    )


def summary_table(history: RunHistory, accuracy: str = "accuracy") -> str:
    """A fixed-width table of every round, then the client errors (``error_lines``).

    ``accuracy`` names what the central accuracy counts (the dataset's ``accuracy``).
    """
    acc = f"central {accuracy}"
    header = (
        f"{'round':>5} {acc:>11} {'central loss':>12} {'trained':>7} "
        f"{'failed':>6} {'train loss':>10} {'peak/budget':>11} {'swapped':>11} "
        f"{'stall s':>7} {'wall s':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in history.rounds:
        lines.append(
            f"{r.server_round:>5} {_num(r.central_acc, 4):>{max(11, len(acc))}} "
            f"{_num(r.central_loss, 4):>12} {r.clients_trained:>7} {r.clients_failed:>6} "
            f"{_num(r.train_loss, 4):>10} {_pct(r.max_peak_fraction):>11} "
            f"{format_bytes(r.bytes_swapped):>11} {r.stall_s:>7.1f} {r.wall_s:>7.1f}"
        )
    lines += error_lines([c.error for c in history.errors() if c.error])
    return "\n".join(lines)


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def error_lines(reasons: Sequence[str]) -> list[str]:
    """One line per distinct reason, reasons that differ only in their numbers counted as one.

    A group shows its first reason; "(numbers vary)" says that its others differ from it in
    byte figures, client numbers or rounds.
    """
    groups: dict[str, list[str]] = {}
    for reason in reasons:
        text = " ".join(reason.split())  # Flower's reasons may span lines
        groups.setdefault(_NUMBER.sub("#", text), []).append(text)
    lines = []
    for texts in groups.values():
        if len(texts) == 1:
            lines.append(f"client error: {texts[0]}")
            continue
        vary = " (numbers vary)" if len(set(texts)) > 1 else ""
        lines.append(f"client error ({len(texts)} x): {texts[0]}{vary}")
    return lines


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def floors_line(floors: PeakMeasurement) -> str:
    """The measured floors a budget is judged by: training state, unmanaged peaks, vtensor's."""
    smaller = ", ".join(f"{b}: {format_bytes(p)}" for b, p in floors.smaller_batch_peaks)
    return (
        f"parameters+gradients+momentum {format_bytes(floors.state_bytes)}; unmanaged peak "
        f"{format_bytes(floors.unmanaged_peak_bytes)} at batch {floors.batch_size}"
        + (f" (batch {smaller})" if smaller else "")
        + (
            f"; smallest workable budget vtensor states {format_bytes(floors.min_budget_bytes)}"
            if floors.min_budget_bytes
            else ""
        )
    )


# NOTE [without vtensor]: a smaller batch, or micro-batches accumulated into the batch's
# update, trains unmanaged where its unmanaged peak fits the budget. None goes below the
# training state (parameters, gradients, optimizer state), which neither the batch size nor
# checkpointing shrinks: below it only offloading the parameter side trains, and "could not
# train" is said there only. Checkpointing between the two is not measured, so not claimed.
def without_vtensor(budget_bytes: int, floors: PeakMeasurement) -> str:
    """What would train within ``budget_bytes`` without vtensor (NOTE [without vtensor])."""
    if budget_bytes >= floors.unmanaged_peak_bytes:
        return "fits as is"
    if budget_bytes < floors.state_bytes:
        return (
            "could not train: budget < parameters+gradients+momentum "
            f"({format_bytes(floors.state_bytes)})"
        )
    for batch, peak in floors.smaller_batch_peaks:
        if budget_bytes >= peak:
            return (
                f"a smaller batch ({batch}) or micro-batching "
                f"({floors.batch_size // batch} x {batch})"
            )
    if floors.smaller_batch_peaks:
        smallest = format_bytes(floors.smaller_batch_peaks[-1][1])
        return f"no smaller batch fits (batch 1: {smallest}); checkpointing not measured"
    return "not at this batch; smaller batches not measured"


def class_table(
    history: RunHistory,
    classes: Sequence[DeviceClass],
    floors: PeakMeasurement,
    reference: ReferenceRound | None,
) -> str:
    """Per device class: budget, peak, bytes swapped, round time, and what trains without vtensor.

    A line of the measured floors (``floors_line``) heads the table. Figures are over every
    successful train reply of the class: the largest peak, the mean bytes swapped (out + in)
    per client and round. Times are apart for the rounds in which vtensor was still deciding
    the class's plan (NOTE [deciding rounds]): "round s" is the mean time of the others, "x
    unmanaged" their CPU time per example against the reference round's (``unmanaged_ratio``;
    the table's last line says so), and "deciding s" the mean time of the deciding ones.
    "without vtensor" is ``without_vtensor`` of the class's budget.
    """
    unmanaged_peak_bytes = floors.unmanaged_peak_bytes
    header = (
        f"{'device class':<14} {'clients':>7} {'budget (% peak)':>17} {'measured peak':>13} "
        f"{'swapped/round':>13} {'round s':>7} {'x unmanaged':>11} {'deciding s':>10}  "
        "without vtensor"
    )
    lines = [floors_line(floors), header, "-" * len(header)]
    rows = [c for c in history.clients if c.phase == "train" and c.error is None]
    fleet = [device.name for device in classes]
    for name in class_names(rows, fleet):  # a deployed node's class: the name it sent
        mine = [c for c in rows if class_of(c, fleet) == name]
        if not mine:
            lines.append(_none_trained(name, classes, floors))
            continue
        budget = int(max(c.metrics[BUDGET_BYTES] for c in mine))
        swapped = _mean([c.metrics[BYTES_SWAPPED_OUT] + c.metrics[BYTES_SWAPPED_IN] for c in mine])
        deciding = [c for c in mine if _deciding(c)]
        decided = [c for c in mine if not _deciding(c)]
        ratio = unmanaged_ratio(decided, reference)
        round_s = _num(_mean([c.metrics[TRAIN_S] for c in decided]) if decided else None, 1)
        deciding_s = _num(_mean([c.metrics[TRAIN_S] for c in deciding]) if deciding else None, 1)
        lines.append(
            f"{name:<14} {len({c.node_id for c in mine}):>7} "
            f"{_budget_cell(budget, unmanaged_peak_bytes):>17} "
            f"{format_bytes(int(max(c.metrics[PEAK_DEVICE_BYTES] for c in mine))):>13} "
            f"{format_bytes(int(swapped)):>13} {round_s:>7} {ratio:>11} {deciding_s:>10}  "
            f"{without_vtensor(budget, floors)}"
        )
    if reference is not None:
        lines.append(
            f"{'unmanaged':<14} {1:>7} {'-':>17} {format_bytes(unmanaged_peak_bytes):>13} "
            f"{format_bytes(0):>13} {reference.train_s:>7.1f} {'1.00x':>11} {'-':>10}  "
            "(reference: client 0's round 1 with vtensor off, timed alone in this run)"
        )
    lines.append(X_UNMANAGED)
    return "\n".join(lines)


def _budget_cell(budget_bytes: int, unmanaged_peak_bytes: int) -> str:
    if not unmanaged_peak_bytes:
        return format_bytes(budget_bytes)
    return f"{format_bytes(budget_bytes)} ({100 * budget_bytes / unmanaged_peak_bytes:.0f}%)"


def _none_trained(name: str, classes: Sequence[DeviceClass], floors: PeakMeasurement) -> str:
    """The line of a class none of whose clients trained: its budget, and why where it is known."""
    device = next((c for c in classes if c.name == name), None)
    if device is None or device.budget.auto:  # a deployed class, or a budget only its node knew
        return f"{name:<14} {0:>7}  none trained (see the client errors)"
    budget = device.budget.of_peak(floors.unmanaged_peak_bytes)
    why = "see the client errors"
    if floors.min_budget_bytes and budget < floors.min_budget_bytes:
        why = (
            "budget < the smallest workable budget vtensor states "
            f"({format_bytes(floors.min_budget_bytes)})"
        )
    cell = _budget_cell(budget, floors.unmanaged_peak_bytes)
    return f"{name:<14} {0:>7} {cell:>17}  none trained: {why}"


X_UNMANAGED = (
    "x unmanaged: CPU s per example of the decided rounds, each client's own process (load from "
    "other processes does not count; swap waits are stall s) / the reference round's"
)


def unmanaged_ratio(replies: Sequence[ClientRound], reference: ReferenceRound | None) -> str:
    """The "x unmanaged" cell of ``replies`` (``X_UNMANAGED``, NOTE [reference round]).

    "-" where a CPU time is missing (a reply or reference without one): no wall-time stand-in.
    """
    if not replies or reference is None or reference.cpu_s_per_example <= 0:
        return "-"
    if any(TRAIN_CPU_S not in c.metrics for c in replies):
        return "-"
    per_example = [
        c.metrics[TRAIN_CPU_S] / max(1.0, c.metrics[EXAMPLES_PROCESSED]) for c in replies
    ]
    return f"{_mean(per_example) / reference.cpu_s_per_example:.2f}x"


# NOTE [deciding rounds]: a class's first round under vtensor decides its plan (NOTE [one
# decision] in vtensor/activations/plan/decision.py: a profile, at most one more, one validating
# replay), once per model, input shape and budget; its later rounds load the plan from the
# class's plan cache. The table keeps the two apart, since a run of a few rounds would otherwise
# state the one-time decision as the cost of every round. A round counts as deciding when its
# client's plan source is profiled or planned (a plan made in that round's process).
_DECIDING = {vtensor.PlanSource.PROFILED, vtensor.PlanSource.PLANNED}


def _deciding(reply: ClientRound) -> bool:
    code = reply.metrics.get(PLAN_SOURCE)
    return code is not None and plan_source_of(code) in _DECIDING


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
