"""The hybrid choice against an exact solver on small traces (the optimality gap, docs/lgm.md)."""

import numpy as np

from tests.vtensor.planner.exact import exact_hybrid_cost
from tests.vtensor.planner.unit_traces import KB, Unit, demand, unit_trace
from vtensor.planner.belady import plan_lgm
from vtensor.planner.lgm import (
    DEFAULT_READ_BYTES_PER_S,
    DEFAULT_WRITE_BYTES_PER_S,
    build_lgm,
    min_budget,
)
from vtensor.planner.recompute import choose_recompute
from vtensor.planner.recomputed import with_recompute
from vtensor.planner.trace import Trace

# A byte moved (out or in) costs half a write and half a read at the planner's default
# bandwidths: the modelled price of swapping that the exact solver weighs against recomputing.
SWAP_S_PER_BYTE = (1 / DEFAULT_WRITE_BYTES_PER_S + 1 / DEFAULT_READ_BYTES_PER_S) / 2
HYBRID_GAP_FACTOR = 2.5  # per case, greedy cost <= exact x this (figures in docs/lgm.md)
HYBRID_MEAN_GAP_FACTOR = 1.15


def _hybrid_cost(trace: Trace, budget: int) -> float:
    """The modelled cost of what the manager keeps: the cheaper of swap-only and the choice."""
    costs = []
    for chosen in {(), choose_recompute(trace, budget)}:
        after = with_recompute(trace, chosen)
        spent = sum(u.forward_s for u in trace.units if u.name in chosen)
        costs.append(spent + SWAP_S_PER_BYTE * plan_lgm(after, budget).bytes_moved)
    return min(costs)


def _gap_cases(count: int, seed: int) -> list[tuple[Trace, int]]:
    rng = np.random.default_rng(seed)
    cases = []
    while len(cases) < count:
        units: list[Unit] = []
        for i in range(int(rng.integers(1, 5))):
            unit: Unit = (
                f"u{i}",
                float(rng.uniform(1e-5, 2e-3)),
                int(rng.integers(1, 300)) * KB,
                bool(rng.random() < 0.8),
            )
            units.append(unit)
        trace = unit_trace(units, int(rng.integers(0, 100)) * KB)
        floor = min_budget(build_lgm(trace, None))[0]
        full = demand(trace)
        if full <= floor:
            continue
        cases.append((trace, int(floor + rng.uniform(0.0, 0.9) * (full - floor))))
    return cases


def test_the_hybrid_choice_is_near_the_exact_optimum() -> None:
    ratios = []
    for trace, budget in _gap_cases(40, seed=3):
        exact, _ = exact_hybrid_cost(trace, budget, SWAP_S_PER_BYTE)
        greedy = _hybrid_cost(trace, budget)
        assert exact <= greedy * (1 + 1e-9), (trace, budget)
        assert greedy <= HYBRID_GAP_FACTOR * exact, (trace, budget, greedy, exact)
        ratios.append(greedy / exact if exact else 1.0)
    assert np.mean(ratios) <= HYBRID_MEAN_GAP_FACTOR
    print(
        f"hybrid greedy / exact modelled cost: mean {np.mean(ratios):.4f}, "
        f"max {max(ratios):.4f}, optimal in {sum(r <= 1 + 1e-9 for r in ratios)}/{len(ratios)}"
    )
