"""What a recomputation costs beyond its unit's ops, in the profile (NOTE [mechanism cost])."""

from pathlib import Path

import torch
from recompute_models import Block, batch, model_with
from torch import nn

import vtensor
from vtensor.activations.recompute.profile.cost import mechanism_costs
from vtensor.planner.recomputed import whole_s


def test_the_mechanism_costs_something_measured_once_per_process() -> None:
    costs = mechanism_costs("cpu")
    # Checkpointing's frame and hooks: well above a timer's resolution, whatever the machine.
    assert costs.checkpoint_s > 0
    assert mechanism_costs("cpu") is costs


def test_the_profile_prices_each_unit_with_the_mechanism(tmp_path: Path) -> None:
    costs = mechanism_costs("cpu")
    model = model_with(Block)
    x, y = batch(0)
    with vtensor.MemoryManager("1GiB", storage_dir=tmp_path, recompute=True) as mm:
        with mm.step(model, None, inputs=(x, y)):
            nn.functional.cross_entropy(model(x), y).backward()
        assert mm.trace is not None
        units = mm.trace.units
    assert {u.name for u in units} >= {str(i) for i in range(1, 7)}  # the blocks
    for unit in units:
        assert unit.overhead_s == costs.checkpoint_s, unit.name
        assert whole_s(unit) == unit.forward_s + costs.checkpoint_s


def test_the_measurement_leaves_the_rng_and_grad_mode_as_they_were() -> None:
    before = torch.get_rng_state()
    mechanism_costs.cache_clear()
    mechanism_costs("cpu")
    assert torch.equal(before, torch.get_rng_state())
    assert torch.is_grad_enabled()
