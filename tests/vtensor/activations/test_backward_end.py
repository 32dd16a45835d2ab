"""The end of backward is the outermost backward's (NOTE [end of backward] in rebuild.py)."""

from pathlib import Path
from typing import Any

import pytest
import torch
from recompute_models import Block as Plain
from recompute_models import batch, model_with, peak_bytes
from test_hybrid_plan import _HybridWins  # the first candidate (block 6 rebuilt) wins
from torch import nn

import vtensor
import vtensor.activations.planning
import vtensor.activations.wiring as wiring
import vtensor.planner.recomputed
from vtensor.activations.quiet import QUIET_RUN
from vtensor.activations.race import ROUNDS
from vtensor.activations.sparse import SparseBoundaries
from vtensor.planner.plan import Plan


def _acting_but_the_head(plan: Plan) -> dict[int, int]:
    """Every step acts but the head's backward: the first backward step acting is block 6's."""
    return {i: 0 for i, name in enumerate(plan.step_names) if name != "backward:7"}


def test_a_sparse_replay_whose_first_backward_step_is_in_a_rebuilt_graph_follows_its_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Block 6 runs backward first of the blocks, through one node whose backward rebuilds its
    # graph and runs it by a backward of its own. A sparse replay whose first acting backward
    # step lies in there marked the end of backward on that inner backward: the replay ended
    # before block 5's steps and left its plan ("never reached"), and the race that kept it
    # started over (ResNet-18 at 80 % of its peak profiled again after 15 steps).
    monkeypatch.setattr(
        vtensor.activations.planning, "recompute_candidates", lambda _t, _b: ((("6",), ()),)
    )
    monkeypatch.setattr(vtensor.activations.planning, "PlanRace", _HybridWins)
    monkeypatch.setattr(vtensor.MemoryManager, "_guard_bytes", lambda *_: 0)
    monkeypatch.setattr(wiring, "acting_steps", _acting_but_the_head)
    # Through one node whatever its forward's tail measured (NOTE [one node or checkpointing]).
    monkeypatch.setattr(vtensor.planner.recomputed, "ONE_NODE_MAX_TAIL_SHARE", 1.0)
    turns: list[str] = []
    made = wiring._sparse

    def spied(*args: Any, verify: bool) -> SparseBoundaries:
        turns.append("check" if verify else "sparse")
        return made(*args, verify=verify)

    monkeypatch.setattr(wiring, "_sparse", spied)
    budget = int(peak_bytes(Plain, tmp_path) * 0.5)
    model, twin = model_with(Plain), model_with(Plain)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.01)
    steps = 2 + 2 * ROUNDS + 2 + QUIET_RUN // 2  # profile, trial, race, then the kept plan
    with vtensor.MemoryManager(budget, storage_dir=tmp_path, recompute=True) as mm:
        for step in range(steps):
            x, y = batch(0)
            for net, optimizer, manager in ((twin, twin_opt, None), (model, opt, mm)):
                torch.manual_seed(step)  # the blocks' dropout
                optimizer.zero_grad(set_to_none=True)
                if manager is None:
                    nn.functional.cross_entropy(net(x), y).backward()
                else:
                    with manager.step(net, optimizer, inputs=(x, y)):
                        nn.functional.cross_entropy(net(x), y).backward()
                optimizer.step()
            for a, b in zip(model.parameters(), twin.parameters(), strict=True):
                assert torch.equal(a, b), f"step {step}"
        reports, plan = mm.reports, mm.plan_for(model, inputs=batch(0))
    sources = [r.plan_source for r in reports]
    assert plan is not None and plan.one_node == ("6",) and plan.moves, " ".join(sources)
    kept = reports[2 + 2 * ROUNDS :]
    assert kept and all(r.recomputed == ("6",) for r in kept), [r.recomputed for r in kept]
    assert "sparse" in turns, turns
    assert "fallback" not in sources and all(r.plan_source == "planned" for r in kept), sources
