"""Human-readable text of a run: the line logged per round and the table printed at the end."""

from edgefl.history import RoundRecord, RunHistory
from vtensor import format_bytes


def round_line(record: RoundRecord, num_rounds: int) -> str:
    """One line per round: central accuracy and loss, clients, memory and swapping, time."""
    central = (
        "central acc -"
        if record.central_acc is None
        else f"central acc {record.central_acc:.4f} loss {record.central_loss:.4f}"
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


def summary_table(history: RunHistory) -> str:
    """A fixed-width table of every round, then the distinct client errors."""
    header = (
        f"{'round':>5} {'central acc':>11} {'central loss':>12} {'trained':>7} "
        f"{'failed':>6} {'train loss':>10} {'peak/budget':>11} {'swapped':>11} "
        f"{'stall s':>7} {'wall s':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in history.rounds:
        lines.append(
            f"{r.server_round:>5} {_num(r.central_acc, 4):>11} {_num(r.central_loss, 4):>12} "
            f"{r.clients_trained:>7} {r.clients_failed:>6} {_num(r.train_loss, 4):>10} "
            f"{_pct(r.max_peak_fraction):>11} {format_bytes(r.bytes_swapped):>11} "
            f"{r.stall_s:>7.1f} {r.wall_s:>7.1f}"
        )
    reasons = sorted({c.error for c in history.errors() if c.error})
    lines += [f"client error: {reason}" for reason in reasons]
    return "\n".join(lines)


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"
