"""Sparse replays (NOTE [sparse replay]): module hooks only at the steps a swapping plan acts at."""

from pathlib import Path
from typing import Any

import pytest
import torch
from test_lean_replay import CHUNK, Hoarder, _peak, _step
from torch import nn

import vtensor
import vtensor.activations.wiring as wiring
from vtensor.activations.quiet import QUIET_RUN
from vtensor.activations.sparse import SparseBoundaries, acting_steps, fullest_steps
from vtensor.planner.plan import Plan, TensorMove


@pytest.fixture
def turns(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, SparseBoundaries]]:
    """The sparse hooks each iteration installs: ("sparse" or "check", the hooks)."""
    seen: list[tuple[str, SparseBoundaries]] = []
    made = wiring._sparse

    def spied(*args: Any, verify: bool) -> SparseBoundaries:
        hooks = made(*args, verify=verify)
        seen.append(("check" if verify else "sparse", hooks))
        return hooks

    monkeypatch.setattr(wiring, "_sparse", spied)
    return seen


def _every_step(plan: Plan) -> dict[int, int]:
    """Every step acts: each module boundary is hooked and counted."""
    return dict.fromkeys(range(len(plan.step_names)), 0)


def _train(
    model: nn.Module,
    x: torch.Tensor,
    budget: int,
    steps: int,
    tmp_path: Path,
    turns: list[Any],
    reads: list[int] | None = None,
) -> tuple[list[str], list[vtensor.IterationReport], Plan | None, list[int]]:
    """``steps`` managed steps, each bit-identical to the unmanaged one.

    The turns, the reports, the plan and the heap-counter readings of each step.
    """
    ref = _step(model, x, None)
    kinds, reports, counts = [], [], []
    with vtensor.MemoryManager(budget, chunk_bytes=CHUNK, storage_dir=tmp_path) as mm:
        for step in range(steps):
            turns.clear()
            if reads is not None:
                reads.clear()
            assert all(map(torch.equal, ref, _step(model, x, mm))), f"step {step}"
            kinds.append(",".join(kind for kind, _ in turns) or "-")
            reports.append(mm.report())
            counts.append(len(reads) if reads is not None else 0)
        plan = mm.plan_for(model, (x,))
    return kinds, reports, plan, counts


def test_a_swapping_plan_replays_sparsely_once_a_check_agreed(
    tmp_path: Path, turns: list[tuple[str, SparseBoundaries]], reads: list[int]
) -> None:
    torch.manual_seed(0)
    model, x = Hoarder(), torch.randn(4096, 64)
    budget = int(0.6 * _peak(model, x))
    steps = 3 + 2 * (QUIET_RUN + 1)
    kinds, reports, plan, counts = _train(model, x, budget, steps, tmp_path, turns, reads)
    assert plan is not None and plan.moves
    first = next(i for i, r in enumerate(reports) if r.lean)
    assert all(r.lean for r in reports[first:])
    # The first lean replay checks the counting beside the full hooks, the next ones hook the
    # acting steps only, and every QUIET_RUN + 1-th checks again.
    assert kinds[:first] == ["-"] * first
    assert kinds[first] == "check"
    after = kinds[first + 1 :]
    assert after[: QUIET_RUN - 1] == ["sparse"] * (QUIET_RUN - 1)
    assert after[QUIET_RUN - 1] == "check" and after[QUIET_RUN] == "sparse"
    # Every replay moves what the plan moves, within the budget. Released in place, a chunk
    # is whole pages of the storage, wherever the allocator put it: up to a chunk per move.
    for report in reports[first:]:
        assert abs(report.bytes_out - reports[first].bytes_out) <= CHUNK * len(plan.moves)
        assert report.peak_device_bytes <= budget + CHUNK
        assert report.plan_source == "planned"
    acting = acting_steps(plan)
    assert 0 < len(acting) < len(plan.step_names)
    # The heap counter is read at the fullest watched steps only (and as the step begins and
    # ends), where the checks read at every watched step.
    sparse = [n for n, kind in zip(counts, kinds, strict=True) if kind == "sparse"]
    checks = [n for n, kind in zip(counts, kinds, strict=True) if kind == "check"]
    assert max(sparse) <= len(fullest_steps(plan)) + 2, sparse
    assert min(checks) >= len(plan.watched_steps), checks


class Twice(nn.Module):
    """A layer that applies its activation twice with no other module in between."""

    def __init__(self, twice: bool) -> None:
        super().__init__()
        self.linear, self.act, self.twice = nn.Linear(64, 64), nn.Tanh(), twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.linear(x))
        return self.act(x) if self.twice else x


@pytest.mark.parametrize("twice", [False, True])
def test_a_plan_replays_sparsely_only_where_a_check_found_every_step_counted(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    turns: list[tuple[str, SparseBoundaries]],
    twice: bool,
) -> None:
    # Two calls of one module with no boundary between them are one step for the full hooks
    # and two calls for the sparse ones: the check finds it, and no replay goes sparse.
    monkeypatch.setattr(wiring, "acting_steps", _every_step)
    torch.manual_seed(0)
    model, x = nn.Sequential(*(Twice(twice) for _ in range(6))), torch.randn(4096, 64)
    budget = int(0.6 * _peak(model, x))
    kinds, reports, plan, _ = _train(model, x, budget, 3 + QUIET_RUN, tmp_path, turns)
    assert plan is not None and plan.moves and reports[-1].lean
    if twice:
        assert "sparse" not in kinds and "check" in kinds, kinds
    else:
        assert kinds.count("sparse") >= QUIET_RUN - 2, kinds


class Skipper(Hoarder):
    """The hoarder, whose forward can skip its last layer (data-dependent control flow)."""

    skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers = self.layers[:-1] if self.skip else self.layers
        for layer in layers:
            x = layer(x)
        return x


def test_a_sparse_replay_that_leaves_its_plan_still_trains_bit_identically(
    tmp_path: Path, turns: list[tuple[str, SparseBoundaries]]
) -> None:
    torch.manual_seed(0)
    model, x = Skipper(), torch.randn(4096, 64)
    budget = int(0.6 * _peak(model, x))
    with vtensor.MemoryManager(budget, chunk_bytes=CHUNK, storage_dir=tmp_path) as mm:
        for _ in range(6):
            turns.clear()
            _step(model, x, mm)
        assert [kind for kind, _ in turns] == ["sparse"]
        # One layer fewer, which no step name of the sparse replay shows before backward; the
        # saved tensors' sizes and positions do.
        model.skip = True
        want = _step(model, x, None)
        turns.clear()
        got = _step(model, x, mm)
        assert [kind for kind, _ in turns] == ["sparse"]
        report = mm.report()
    assert all(map(torch.equal, want, got))
    assert report.plan_source == "fallback" and not report.lean


def test_the_steps_a_plan_acts_at_and_the_writes_each_leaves_in_flight() -> None:
    names = (
        "other:start",  # 0
        "forward:a",  # 1
        "forward:b",  # 2
        "forward:c",  # 3
        "forward:d",  # 4
        "backward:d",  # 5
        "backward:c",  # 6
        "backward:b",  # 7
        "backward:a",  # 8
        "other:after-backward",  # 9
    )
    move = TensorMove(vid=0, evict_bytes=100, evict_step=2, prefetch_step=7)

    def plan(watched: tuple[int, ...], headroom: tuple[int, ...]) -> Plan:
        return Plan(
            1000, None, (move,), names, (100,), 900, 0.0, "test",
            watched_steps=watched, step_headroom_bytes=headroom,
        )  # fmt: skip

    # Room for the write everywhere: the move's steps (its write starts a step early) and the
    # fullest watched step; each may leave in flight what fits every step until the next.
    roomy = plan((4, 6), (500, 500, 400, 300, 200, 250, 300, 500, 500, 500))
    assert acting_steps(roomy) == {0: 500, 1: 500, 2: 300, 4: 200, 7: 500}
    # A step whose headroom is below the write that may be in flight there, from the step
    # before the eviction's to the restore's, may have to wait: it acts too.
    tight = plan((4,), (500, 500, 500, 50, 500, 50, 500, 50, 50, 500))
    assert acting_steps(tight) == {0: 500, 1: 500, 2: 500, 3: 50, 4: 500, 5: 50, 7: 50}
    # A watched end of backward is reached from the first backward step, which marks it.
    ends = plan((9,), (500,) * 10)
    assert set(acting_steps(ends)) == {0, 1, 2, 5, 7, 9}
