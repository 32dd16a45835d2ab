"""Quiet replays (NOTE [quiet replay]): no saved-tensor hooks where the plan moves nothing."""

import random
from pathlib import Path

import pytest
import torch
from counting import count_calls
from recompute_models import Block, Names, batch, model_with, peak_bytes
from test_hybrid_plan import _HybridWins
from test_lean_replay import Hoarder, _step
from torch import nn

import vtensor
import vtensor.activations.planning
import vtensor.activations.wiring
from vtensor.activations.quiet import QUIET_RUN, QuietTurns, watched_modules
from vtensor.planner.plan import Plan
from vtensor.planner.trace import Trace


@pytest.fixture
def hooked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the iterations that install the manager's saved-tensor hooks."""
    return count_calls(monkeypatch, vtensor.activations.wiring, "make_saved_tensor_hooks")


def test_lean_replays_of_a_plan_that_moves_nothing_go_quiet_between_checking_ones(
    tmp_path: Path, hooked: list[int], reads: list[int]
) -> None:
    torch.manual_seed(0)
    model, x = Hoarder(), torch.randn(2048, 64)
    ref = _step(model, x, None)
    quiet, lean, reads_quiet = [], [], []
    with vtensor.MemoryManager("1GiB", storage_dir=tmp_path) as mm:
        for _ in range(3 + 2 * (QUIET_RUN + 1)):
            hooked.clear()
            reads.clear()
            assert all(map(torch.equal, ref, _step(model, x, mm)))  # bit-identical throughout
            lean.append(mm.report().lean)
            quiet.append(not hooked)
            if not hooked:
                reads_quiet.append(len(reads))
                assert mm.report().peak_device_bytes > 0  # read at the predicted peak
    first = lean.index(True)
    assert not any(quiet[:first]) and all(lean[first:])
    # The full replay before the first lean one matched every saved tensor: QUIET_RUN quiet
    # replays follow it, then one that matches every saved tensor, and so on.
    period = [True] * QUIET_RUN + [False]
    want = (period * 3)[: len(quiet) - first]
    assert quiet[first:] == want
    assert max(reads_quiet) <= 3  # entry, the predicted peak's module, the end


def test_managers_sharing_a_plan_cache_keep_one_count_of_quiet_turns(
    tmp_path: Path, hooked: list[int]
) -> None:
    # The main job opens a manager a round: the count goes on from one to the next, so a
    # manager loading the plan from the cache does not begin with a checking replay.
    torch.manual_seed(0)
    model, x = Hoarder(), torch.randn(2048, 64)
    cache = tmp_path / "plans"

    def quiet_turns(manager: vtensor.MemoryManager, steps: int) -> list[bool]:
        """Whether each lean replay of ``steps`` was quiet."""
        quiet = []
        with manager:
            for _ in range(steps):
                hooked.clear()
                _step(model, x, manager)
                if manager.report().lean:
                    quiet.append(not hooked)
        return quiet

    first = quiet_turns(
        vtensor.MemoryManager("1GiB", storage_dir=tmp_path, plan_cache_dir=cache), 6
    )
    assert first[-2:] == [True, True]  # in a quiet run
    # The same cache, named by another path: the count goes on from the first manager's,
    # whose plan this one loads (every replay lean), quiet from its first step.
    again = vtensor.MemoryManager(
        "1GiB", storage_dir=tmp_path, plan_cache_dir=cache / ".." / "plans"
    )
    second = quiet_turns(again, QUIET_RUN)
    assert len(second) == QUIET_RUN
    run = next((i for i, q in enumerate(reversed(first)) if not q), len(first))
    assert second.index(False) == QUIET_RUN - run
    # Without a cache, or with another, a manager keeps a count of its own.
    assert QuietTurns.shared(cache) is QuietTurns.shared(str(cache / ".." / "plans"))
    assert QuietTurns.shared(tmp_path / "other") is not QuietTurns.shared(cache)
    assert QuietTurns.shared(None) is not QuietTurns.shared(None)


def _every_block_whole(trace: Trace, _budget_bytes: int) -> tuple[tuple[Names, Names], ...]:
    names = tuple(sorted(u.name for u in trace.units if u.safe and "." not in u.name))
    return ((names, ()),)


def test_a_quiet_replay_of_a_recomputing_plan_trains_bit_identically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hooked: list[int]
) -> None:
    # Recomputation (with dropout: its RNG state restored) runs as in any replay.
    monkeypatch.setattr(vtensor.activations.planning, "recompute_candidates", _every_block_whole)
    monkeypatch.setattr(vtensor.activations.planning, "PlanRace", _HybridWins)
    budget = int(peak_bytes(Block, tmp_path) * 0.6)
    runs = []
    for manager in (None, vtensor.MemoryManager(budget, storage_dir=tmp_path, recompute=True)):
        model = model_with(Block)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        grads, quiet = [], 0
        for step in range(14):
            x, y = batch(step % 2)  # two batches of one signature: the plan is replayed
            opt.zero_grad(set_to_none=True)
            random.seed(step)
            torch.manual_seed(100 + step)  # dropout
            hooked.clear()
            if manager is None:
                nn.functional.cross_entropy(model(x), y).backward()
            else:
                with manager.step(model, opt, inputs=(x, y)):
                    nn.functional.cross_entropy(model(x), y).backward()
                report = manager.report()
                quiet += not hooked and bool(report.recomputed) and report.lean
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
            opt.step()
        if manager is not None:
            plan = manager.plan_for(model, inputs=batch(0))
            manager.close()
            assert plan is not None and plan.recompute and not plan.moves
            assert quiet >= QUIET_RUN // 2, quiet
        runs.append((grads, model.state_dict()))
    (want, want_state), (got, got_state) = runs
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True)), f"step {step}"
    assert all(torch.equal(want_state[k], got_state[k]) for k in want_state)


def test_a_quiet_replay_reads_at_its_fullest_watched_steps_only() -> None:
    names = ("other:start", "forward:a", "forward:b", "backward:b", "backward:a")
    plan = Plan(
        100, None, (), names, (), 90, 0.0, "test",
        watched_steps=(1, 2, 3), step_headroom_bytes=(100, 40, 10, 10, 60),
    )  # fmt: skip
    assert watched_modules(plan) == [("forward", "b"), ("backward", "b")]
    # A watched step that is no module's boundary: no quiet replay of that plan.
    other = Plan(
        100, None, (), names, (), 90, 0.0, "test",
        watched_steps=(0, 2), step_headroom_bytes=(5, 40, 10, 10, 60),
    )  # fmt: skip
    assert watched_modules(other) is None
