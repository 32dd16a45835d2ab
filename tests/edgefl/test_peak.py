"""Relative budgets resolve against the measured peak; the smallest workable budget stated."""

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from edgefl.budget import Budget
from edgefl.data import load_dataset
from edgefl.errors import ClientBudgetError
from edgefl.models import build_model
from edgefl.peak import measure_floors, measure_unmanaged_peak, resolve_budget
from edgefl.settings import OffloadParams, VTensorSettings
from edgefl.train import LocalRound, train_within_budget


def test_a_small_test_set_does_not_shrink_the_training_budget_under_the_same_key() -> None:
    bundle = load_dataset("mnist")
    torch.manual_seed(0)
    model = build_model("cnn", bundle.info, {"width": 4, "hidden": 16})
    key = ("test_peak", "cnn", 32)
    few = resolve_budget(
        Budget(peak_fraction=0.5), model, bundle.train.subset(np.arange(4)), 32, key
    )
    full = resolve_budget(
        Budget(peak_fraction=0.5), model, bundle.train.subset(np.arange(64)), 32, key
    )
    assert full > few  # measured again on a full batch, not the small set's cached peak
    again = resolve_budget(
        Budget(peak_fraction=0.5), model, bundle.train.subset(np.arange(64)), 32, key
    )
    assert again == full


def test_the_smallest_workable_budget_is_the_one_a_client_states(tmp_path: Path) -> None:
    """The simulation's warning and a client's error name one figure, and it trains."""
    bundle = load_dataset("mnist")
    torch.manual_seed(0)
    model = build_model("cnn", bundle.info, {"width": 16, "hidden": 64})
    data = bundle.train.subset(np.arange(128))
    settings = VTensorSettings(offload_params=OffloadParams.OFF)
    measured = measure_unmanaged_peak(copy.deepcopy(model), data, 128, settings=settings)
    assert 0 < measured.min_budget_bytes < measured.unmanaged_peak_bytes
    local = LocalRound(lr=0.01, momentum=0.9, epochs=1, batch_size=128, seed=0)

    def train_at(budget: int) -> None:
        train_within_budget(
            copy.deepcopy(model),
            data,
            local,
            settings=settings,
            budget_bytes=budget,
            plan_cache_dir=tmp_path / str(budget),
        )

    with pytest.raises(ClientBudgetError) as raised:
        train_at(measured.min_budget_bytes // 4)
    stated = raised.value.min_budget_bytes
    assert abs(stated - measured.min_budget_bytes) <= 0.05 * measured.min_budget_bytes
    train_at(max(stated, measured.min_budget_bytes))  # the figure works


def test_floors_hold_the_training_state_and_the_peaks_at_smaller_batches() -> None:
    """Parameters + gradients + momentum, and the unmanaged peak at 8, 4, 2 and 1 for batch 16."""
    bundle = load_dataset("mnist")
    torch.manual_seed(0)
    model = build_model("mlp", bundle.info, {"hidden": 64, "layers": 2})
    floors = measure_floors(model, bundle.train.subset(np.arange(64)), 16, lr=0.05, momentum=0.9)
    parameter_bytes = sum(p.nbytes for p in model.parameters())
    assert floors.state_bytes == 3 * parameter_bytes  # SGD keeps one momentum per parameter
    assert floors.batch_size == 16
    assert floors.min_budget_bytes == 0  # without a client's vtensor settings none is stated
    assert [b for b, _ in floors.smaller_batch_peaks] == [8, 4, 2, 1]
    peaks = [floors.unmanaged_peak_bytes] + [p for _, p in floors.smaller_batch_peaks]
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] >= floors.state_bytes
