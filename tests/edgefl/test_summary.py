"""The end-of-run table per device class, from plain client rows."""

import vtensor
from edgefl.budget import Budget
from edgefl.history import ClientRound, RunHistory
from edgefl.peak import PeakMeasurement
from edgefl.records import plan_source_code
from edgefl.reference import ReferenceRound
from edgefl.settings import DeviceClass
from edgefl.summary import class_table, floors_line, summary_table, without_vtensor

MIB = 1 << 20
CLASSES = (
    DeviceClass("micro", Budget(peak_fraction=0.4), 0.5),
    DeviceClass("roomy", Budget(bytes=200 * MIB), 0.5),
)
# Training state 60 MiB; unmanaged peak 100 MiB at batch 32, less at smaller batches.
SMALLER = ((16, 80 * MIB), (8, 70 * MIB), (4, 65 * MIB), (2, 62 * MIB), (1, 61 * MIB))
FLOORS = PeakMeasurement(100 * MIB, 20 * MIB, 60 * MIB, 32, SMALLER)


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
        "train-cpu-s": train_s,  # as if alone on its core: CPU time = wall time
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
    table = class_table(_history(), CLASSES, FLOORS, ReferenceRound(2.0, 100, cpu_s=2.0))
    micro = next(line for line in table.splitlines() if line.startswith("micro"))
    assert "40.0 MiB (40%)" in micro
    assert "38.0 MiB" in micro  # the larger of its clients' peaks
    assert "6.0 MiB" in micro  # swapped out + in per client and round
    assert "2.50x" in micro  # 5 s per 100 examples against the reference's 2 s
    assert "could not train: budget < parameters+gradients+momentum (60.0 MiB)" in micro
    roomy = next(line for line in table.splitlines() if line.startswith("roomy"))
    assert "fits as is" in roomy and "0.50x" in roomy
    reference = next(line for line in table.splitlines() if line.startswith("unmanaged"))
    assert "1.00x" in reference and "2.0" in reference and "100.0 MiB" in reference
    floors = table.splitlines()[0]  # the floors the budgets are judged by, above the table
    assert "parameters+gradients+momentum 60.0 MiB" in floors
    assert "100.0 MiB at batch 32 (batch 16: 80.0 MiB" in floors and "1: 61.0 MiB)" in floors
    assert "smallest workable budget vtensor states 20.0 MiB" in floors


def test_floors_name_no_vtensor_minimum_where_none_was_stated() -> None:
    """A run with vtensor off measures no smallest workable budget, and says none."""
    floors = floors_line(PeakMeasurement(100 * MIB, 0, 60 * MIB, 32, SMALLER))
    assert "parameters+gradients+momentum 60.0 MiB" in floors and "vtensor" not in floors


def test_without_vtensor_says_could_not_train_only_below_the_training_state() -> None:
    """By the measured floors: below the state nothing trains; else the largest smaller batch
    whose unmanaged peak fits (or that many micro-batches of it); at the peak, as is."""
    assert without_vtensor(59 * MIB, FLOORS) == (
        "could not train: budget < parameters+gradients+momentum (60.0 MiB)"
    )
    assert without_vtensor(60 * MIB, FLOORS).startswith("no smaller batch fits (batch 1: 61.0")
    assert without_vtensor(75 * MIB, FLOORS) == "a smaller batch (8) or micro-batching (4 x 8)"
    assert without_vtensor(80 * MIB, FLOORS) == "a smaller batch (16) or micro-batching (2 x 16)"
    assert without_vtensor(100 * MIB, FLOORS) == "fits as is"


def test_class_table_without_reference_or_replies() -> None:
    table = class_table(RunHistory(), CLASSES, FLOORS, None)
    micro = next(line for line in table.splitlines() if line.startswith("micro"))
    assert "40.0 MiB (40%)" in micro and "none trained" in micro
    assert "unmanaged " not in table.splitlines()[-1]


def test_class_table_says_why_a_class_below_the_stated_minimum_trained_nothing() -> None:
    tiny = DeviceClass("tiny", Budget(bytes=1 << 10), 0.5)
    table = class_table(RunHistory(), (tiny, *CLASSES), FLOORS, None)
    line = next(line for line in table.splitlines() if line.startswith("tiny"))
    assert "1.0 KiB (0%)" in line
    assert "none trained: budget < the smallest workable budget vtensor states (20.0 MiB)" in line


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
    table = class_table(history, CLASSES, FLOORS, ReferenceRound(2.0, 100, cpu_s=2.0))
    # round s: the cached rounds' mean; x unmanaged: 2.5 s per 100 examples against 2 s per 100;
    # deciding s: the profiled and planned rounds' mean
    assert _times(table, "micro") == ["2.5", "1.25x", "6.0"]


def test_class_table_with_only_deciding_rounds() -> None:
    history = RunHistory()
    history.clients.append(_reply(1, vtensor.PlanSource.PROFILED, 4.0))
    table = class_table(history, CLASSES, FLOORS, ReferenceRound(2.0, 100, cpu_s=2.0))
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
