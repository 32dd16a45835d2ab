"""The inclusion benchmark's decisions: what local tricks train, and which targets it checks."""

from typing import Any

import pytest
import torch

from benchmarks.inclusion import AS_IS, DROPPED, checks, local_tricks_plan
from edgefl.budget import Budget
from edgefl.peak import PeakMeasurement
from edgefl.settings import DeviceClass

MIB = 1 << 20
# A model whose training state is 40 MiB and whose unmanaged peak is 48 MiB at batch 64.
FLOORS = PeakMeasurement(48 * MIB, 20 * MIB, 40 * MIB, 64, ((32, 44 * MIB), (16, 42 * MIB)))


def test_local_tricks_drop_a_class_below_the_state_and_train_one_at_the_peak_as_is() -> None:
    classes = [
        DeviceClass("starved", Budget(peak_fraction=0.6), 0.5),
        DeviceClass("ample", Budget(128 * MIB), 0.5),
    ]
    plan = local_tricks_plan(classes, FLOORS)
    assert plan["starved"].startswith(DROPPED)
    assert plan["ample"] == AS_IS


def test_local_tricks_refuse_a_budget_that_a_smaller_batch_would_fit() -> None:
    classes = [DeviceClass("between", Budget(45 * MIB), 1.0)]
    with pytest.raises(ValueError, match=r"between.*batch"):
        local_tricks_plan(classes, FLOORS)


def _result(variant: str, weight: float) -> dict[str, Any]:
    return {"variant": variant, "final_state": {"w": torch.full((2,), weight)}}


def _summary(variant: str, central: float, starved: float, wall_s: float) -> dict[str, Any]:
    return {
        "variant": variant,
        "final_central_acc": central,
        "final_starved_only_acc": starved,
        "median_wall_s": wall_s,
    }


def test_checks_compare_edgefl_with_each_variant_run_and_ample_bit_for_bit() -> None:
    results = [_result("fits_only", 1.0), _result("edgefl", 2.0), _result("ample", 2.0)]
    summaries = [
        _summary("fits_only", 0.6, 0.0, 10.0),
        _summary("edgefl", 0.9, 0.8, 20.0),
        _summary("ample", 0.9, 0.8, 12.5),
    ]
    out = checks(results, summaries)
    assert out["edgefl_minus_fits_only_starved_only_points"] == pytest.approx(80.0)
    assert out["wall_edgefl_over_ample"] == pytest.approx(1.6)
    assert out["edgefl_equals_ample_bit_for_bit"] is True
    assert not any("heterofl" in key for key in out)  # only the variants run


def test_checks_without_edgefl_or_ample_claim_nothing_they_cannot_compare() -> None:
    assert checks([_result("fits_only", 1.0)], [_summary("fits_only", 0.6, 0.0, 1.0)]) == {}
    out = checks([_result("edgefl", 1.0)], [_summary("edgefl", 0.9, 0.8, 1.0)])
    assert "edgefl_equals_ample_bit_for_bit" not in out
