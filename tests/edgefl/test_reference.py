"""The unmanaged reference round and the "x unmanaged" ratio of the per-class table."""

import vtensor
from edgefl.history import ClientRound
from edgefl.records import EXAMPLES_PROCESSED, TRAIN_CPU_S, TRAIN_S, plan_source_code
from edgefl.reference import ReferenceRound, time_unmanaged_round
from edgefl.settings import RunSettings
from edgefl.summary import X_UNMANAGED, unmanaged_ratio


def _reply(wall_s: float, cpu_s: float | None) -> ClientRound:
    metrics = {
        TRAIN_S: wall_s,
        EXAMPLES_PROCESSED: 100.0,
        "plan-source": float(plan_source_code(vtensor.PlanSource.CACHED)),
    }
    if cpu_s is not None:
        metrics[TRAIN_CPU_S] = cpu_s
    return ClientRound(2, "train", 1, metrics)


def test_x_unmanaged_compares_cpu_time_so_load_from_other_processes_does_not_count() -> None:
    """Under load a client's wall time grows 4x; its own CPU time, and the ratio, do not."""
    reference = ReferenceRound(train_s=2.0, examples_processed=100, cpu_s=2.0)
    loaded = [_reply(wall_s=9.6, cpu_s=2.4), _reply(wall_s=8.0, cpu_s=2.4)]
    assert unmanaged_ratio(loaded, reference) == "1.20x"
    assert "CPU" in X_UNMANAGED and "other processes" in X_UNMANAGED


def test_x_unmanaged_is_not_stated_without_cpu_times() -> None:
    """No wall-time stand-in: a ratio of another kind would read as this one."""
    reference = ReferenceRound(train_s=2.0, examples_processed=100, cpu_s=2.0)
    assert unmanaged_ratio([_reply(4.0, None)], reference) == "-"
    assert unmanaged_ratio([_reply(4.0, 2.0)], ReferenceRound(2.0, 100)) == "-"
    assert unmanaged_ratio([], reference) == "-"
    assert unmanaged_ratio([_reply(4.0, 2.0)], None) == "-"


def test_the_reference_round_measures_its_cpu_time(smoke_settings: RunSettings) -> None:
    reference = time_unmanaged_round(smoke_settings.client, smoke_settings.server.num_supernodes)
    assert reference.examples_processed > 0
    assert reference.cpu_s > 0 and reference.cpu_s_per_example > 0
