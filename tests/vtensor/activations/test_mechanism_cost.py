"""What a recomputation costs beyond its unit's ops, in the profile (NOTE [mechanism cost])."""

from pathlib import Path

import torch
from test_cached_products import Inverted, Plain, _model, _units

from vtensor.activations.rerun_cost import mechanism_costs
from vtensor.planner.recomputed import through_one_node, whole_s


def test_each_mechanism_costs_something_measured_once_per_process() -> None:
    costs = mechanism_costs("cpu")
    # A node and a nested engine run, or checkpointing's frame and hooks: well above a timer's
    # resolution, whatever the machine.
    assert costs.one_node_s > 0 and costs.checkpoint_s > 0
    assert costs.cached_call_s >= 0
    assert mechanism_costs("cpu") is costs


def test_the_profile_prices_each_unit_with_its_mechanism(tmp_path: Path) -> None:
    costs = mechanism_costs("cpu")
    units = _units(_model(Inverted, Plain), tmp_path)
    assert units
    for unit in units.values():
        way_s = costs.one_node_s if through_one_node(unit) else costs.checkpoint_s
        assert unit.overhead_s == way_s, unit.name
        assert whole_s(unit) == unit.forward_s + way_s
    cached, plain = units["1.body"], units["2"]  # the block's body: NOTE [one unit per tensors]
    assert cached.cached_products and not plain.cached_products
    # Behind one node with three convolutions answered from what the first run kept; the unit
    # calling F.conv2d and a matrix product goes through torch's selective checkpointing.
    assert cached.selective_s >= costs.one_node_s + 3 * costs.cached_call_s
    assert plain.selective_safe and plain.selective_s >= costs.checkpoint_s


def test_the_measurement_leaves_the_rng_and_grad_mode_as_they_were() -> None:
    before = torch.get_rng_state()
    mechanism_costs.cache_clear()
    mechanism_costs("cpu")
    assert torch.equal(before, torch.get_rng_state())
    assert torch.is_grad_enabled()
