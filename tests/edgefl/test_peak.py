"""Relative budgets resolve against the peak of the batch the data actually gives."""

import numpy as np
import torch

from edgefl.budget import Budget
from edgefl.data import load_dataset
from edgefl.models import build_model
from edgefl.peak import resolve_budget


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
