"""The end-of-run table per device class, from plain client rows."""

import vtensor
from edgefl.budget import Budget
from edgefl.history import ClientRound, RunHistory
from edgefl.records import plan_source_code
from edgefl.reference import ReferenceRound
from edgefl.settings import DeviceClass
from edgefl.summary import class_table, summary_table

MIB = 1 << 20
CLASSES = (
    DeviceClass("micro", Budget(peak_fraction=0.4), 0.5),
    DeviceClass("roomy", Budget(bytes=200 * MIB), 0.5),
)


def _row(
    node: int, device_class: int, budget_mib: int, peak_mib: int, train_s: float
) -> ClientRound:
    metrics = {
        "device-class": float(device_class),
        "budget-bytes": float(budget_mib * MIB),
        "peak-device-bytes": float(peak_mib * MIB),
        "bytes-swapped-out": float(3 * MIB),
        "bytes-swapped-in": float(3 * MIB),
        "train-s": train_s,
        "examples-processed": 100.0,
    }
    return ClientRound(1, "train", node, metrics)


def _history() -> RunHistory:
    history = RunHistory()
    history.clients += [
        _row(1, 0, 40, 30, 4.0),
        _row(2, 0, 40, 38, 6.0),
        _row(3, 1, 200, 99, 1.0),
        ClientRound(1, "train", 4, {}, "cannot train within its budget"),
    ]
    return history


def test_class_table_states_budget_peaks_swap_and_time_per_class() -> None:
    table = class_table(_history(), CLASSES, 100 * MIB, ReferenceRound(2.0, 100))
    micro = next(line for line in table.splitlines() if line.startswith("micro"))
    assert "40.0 MiB (40%)" in micro
    assert "100.0 MiB" in micro  # the unmanaged peak
    assert "38.0 MiB" in micro  # the larger of its clients' peaks
    assert "6.0 MiB" in micro  # swapped out + in per client and round
    assert "2.50x" in micro  # 5 s per 100 examples against the reference's 2 s
    assert "could not train (budget < unmanaged peak)" in micro
    roomy = next(line for line in table.splitlines() if line.startswith("roomy"))
    assert "could train unmanaged" in roomy and "0.50x" in roomy
    reference = next(line for line in table.splitlines() if line.startswith("unmanaged"))
    assert "1.00x" in reference and "2.0" in reference


def test_class_table_without_reference_or_replies() -> None:
    table = class_table(RunHistory(), CLASSES, 100 * MIB, None)
    assert "micro" in table and "no successful round" in table
    assert "unmanaged " not in table.splitlines()[-1]


def _times(table: str, name: str) -> list[str]:
    """The class's round s, x unmanaged and deciding s cells (after its swapped bytes)."""
    line = next(line for line in table.splitlines() if line.startswith(name))
    return line.split("6.0 MiB", 1)[1].split()[:3]


def _reply(server_round: int, source: vtensor.PlanSource, train_s: float) -> ClientRound:
    row = _row(server_round, 0, 40, 30, train_s)
    metrics = {**row.metrics, "plan-source": float(plan_source_code(source))}
    return ClientRound(server_round, "train", server_round, metrics)


def test_class_table_states_deciding_rounds_apart() -> None:
    """Rounds that profiled or made a plan are timed apart from those on a cached plan."""
    history = RunHistory()
    history.clients += [
        _reply(1, vtensor.PlanSource.PROFILED, 9.0),
        _reply(2, vtensor.PlanSource.PLANNED, 5.0),  # its plan made in this round's process
        _reply(2, vtensor.PlanSource.PROFILED, 4.0),  # another client of the class, profiling
        _reply(3, vtensor.PlanSource.CACHED, 3.0),
        _reply(4, vtensor.PlanSource.CACHED, 2.0),
    ]
    table = class_table(history, CLASSES, 100 * MIB, ReferenceRound(2.0, 100))
    # round s: the cached rounds' mean; x unmanaged: 2.5 s per 100 examples against 2 s per 100;
    # deciding s: the profiled and planned rounds' mean
    assert _times(table, "micro") == ["2.5", "1.25x", "6.0"]


def test_class_table_with_only_deciding_rounds() -> None:
    history = RunHistory()
    history.clients.append(_reply(1, vtensor.PlanSource.PROFILED, 4.0))
    table = class_table(history, CLASSES, 100 * MIB, ReferenceRound(2.0, 100))
    assert _times(table, "micro") == ["-", "-", "4.0"]


def test_summary_table_counts_client_errors_that_differ_only_in_numbers() -> None:
    history = RunHistory()
    history.clients += [
        ClientRound(r, "train", 3, {}, f"client 3 (device class micro): budget {b} MiB too small")
        for r, b in ((1, "7.5"), (2, "7.6"), (3, "7.5"))
    ]
    history.clients.append(ClientRound(3, "train", 5, {}, "data missing"))
    errors = [line for line in summary_table(history).splitlines() if "client error" in line]
    assert errors == [
        "client error (3 x): client 3 (device class micro): budget 7.5 MiB too small "
        "(numbers vary)",
        "client error: data missing",
    ]
