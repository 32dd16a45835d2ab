"""One decision per signature (NOTE [one decision]): profile, at most one reprofile, one
validating replay; a hybrid plan from the calibrated model; a cached one in a fresh process."""

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from recompute_models import (
    MIB,
    Block,
    assert_same,
    batch,
    managed_steps,
    model_with,
    peak_bytes,
    train,
)
from torch import nn

import vtensor
from vtensor.activations.plan.decision import Decision, PlanBook, Profile, Stage
from vtensor.activations.plan.iteration_plan import IterationPlan, Recomputation
from vtensor.activations.report import PlanSource
from vtensor.activations.runtime.live import LiveBytes
from vtensor.planner.costs import Costs
from vtensor.planner.plan import Plan
from vtensor.planner.trace import Trace


def every_block(trace: Trace) -> tuple[str, ...]:
    """The top-level blocks that are safe to recompute."""
    return tuple(sorted(u.name for u in trace.units if u.safe and "." not in u.name))


def _recompute_every_block(book: PlanBook, profile: Profile, plan: Plan | None) -> Recomputation:
    trace = profile[0]
    return Recomputation.of(trace, every_block(trace))


def _profiled(tmp_path: Path, fraction: float = 0.6) -> tuple[PlanBook, Profile]:
    """A plan book at ``fraction`` of the model's peak and the profile of one iteration."""
    budget = int(peak_bytes(Block, tmp_path) * fraction)
    model = model_with(Block)
    with vtensor.MemoryManager(
        budget, storage_dir=tmp_path, recompute=True, offload_params=False
    ) as mm:
        managed_steps(mm, model, 1)  # the first profile, whatever the solver then chose
        trace = mm.trace
        assert trace is not None and trace.units
        book = mm._plans
        minimum = max(r.min_budget_bytes for r in mm.reports)
    return book, (trace, MIB, minimum)


def test_a_recomputation_is_profiled_once_then_validated_and_decided_by_the_third_iteration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(PlanBook, "_solve", _recompute_every_block)
    budget = int(peak_bytes(Block, tmp_path) * 0.6)
    model = model_with(Block)
    with vtensor.MemoryManager(budget, storage_dir=tmp_path, recompute=True) as mm:
        grads = train(model, mm)
        reports = mm.reports
    sources = [r.plan_source for r in reports]
    assert sources == ["profiled", "profiled", "planned", "planned"], sources
    assert reports[0].recomputed == () and reports[1].recomputed  # the reprofile recomputes
    assert reports[2].recomputed == reports[1].recomputed  # the validating replay
    # Planned once more from the corrected model, the decision may keep swapping alone.
    assert reports[3].recomputed in (reports[1].recomputed, ())
    assert all(r.peak_device_bytes <= r.budget_bytes + MIB for r in reports)
    assert_same(Block, model, grads)


def test_the_solver_recomputes_only_where_the_model_predicts_it_faster(tmp_path: Path) -> None:
    book, profile = _profiled(tmp_path)
    plan = book._plan(profile)
    assert plan is not None and plan.moves  # swapping alone moves bytes at this budget
    # Swapping that costs a second a byte loses to any recomputation that frees those bytes.
    book.costs = Costs(swap_cpu_s_per_byte=1.0)
    assert book._solve(profile, plan).names
    # Free swapping against recomputation that costs an hour a unit: nothing is recomputed.
    book.costs = Costs(write_bytes_per_s=1e18, read_bytes_per_s=1e18)
    slow = tuple(dataclasses.replace(u, forward_s=3600.0) for u in profile[0].units)
    slow_trace = dataclasses.replace(profile[0], units=slow)
    assert book._solve((slow_trace, *profile[1:]), plan).names == ()


def test_a_validating_replay_that_needed_the_guard_plans_once_more_below_it(
    tmp_path: Path,
) -> None:
    book, profile = _profiled(tmp_path)
    plan = book._plan(profile)
    assert plan is not None
    decision = Decision(Stage.VALIDATE, plan, (profile,), predicted_s=1.0)
    decided = book._validated(decision, plan, wall_s=1.0, guard_bytes=MIB // 4)
    assert decided.stage is Stage.DECIDED and decided.plan is not None
    assert decided.plan.budget_bytes <= plan.budget_bytes - MIB // 4 and not decided.lean
    # A replay that met its prediction without the guard keeps its plan, lean from now on.
    clean = book._validated(decision, plan, wall_s=1.05, guard_bytes=0)
    assert clean.stage is Stage.DECIDED and clean.plan is plan and clean.lean


def test_a_replay_that_misses_its_prediction_corrects_the_per_byte_cost(tmp_path: Path) -> None:
    book, profile = _profiled(tmp_path)
    plan = book._plan(profile)
    assert plan is not None and plan.moves
    predicted = book.costs.step_s(profile[0], plan)
    decision = Decision(Stage.VALIDATE, plan, (profile,), predicted_s=predicted)
    decided = book._validated(decision, plan, wall_s=2 * predicted + 1.0, guard_bytes=0)
    assert book.costs.swap_cpu_s_per_byte > 0
    assert book.costs.step_s(profile[0], plan) == pytest.approx(2 * predicted + 1.0)
    assert decided.stage is Stage.DECIDED and decided.plan is not None


def test_a_recomputation_that_breaks_the_budget_gives_way_to_swapping(tmp_path: Path) -> None:
    book, profile = _profiled(tmp_path)
    choice = Recomputation(("3",))
    book._decisions["sig"] = Decision(Stage.REPROFILE, None, (profile,), choice)
    reprofile = IterationPlan("sig", PlanSource.PROFILED, record_trace=True, recomputation=choice)
    assert book.excuse(reprofile, was_lean=False)
    after = book._decisions["sig"]
    assert after.stage is Stage.VALIDATE and after.plan is not None
    assert after.plan.recompute == ()
    # A full replay of a plan without recomputation that breaks the budget is not excused.
    replay = IterationPlan("sig", PlanSource.PLANNED)
    assert not book.excuse(replay, was_lean=False)


def test_a_cached_hybrid_plan_trains_bit_identically_in_a_fresh_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The child runs one intra-op thread, as the suite does (conftest.py): with two, tanh can
    # differ in its last bits between processes (docs/vtensor.md, "Recomputation").
    monkeypatch.setattr(PlanBook, "_solve", _recompute_every_block)
    monkeypatch.setattr(  # the validating replay keeps the hybrid plan
        PlanBook,
        "_validated",
        lambda _book, decision, *_: dataclasses.replace(decision, stage=Stage.DECIDED),
    )
    cache = tmp_path / "plans"
    budget = int(peak_bytes(Block, tmp_path) * 0.6)
    model = model_with(Block)
    with vtensor.MemoryManager(
        budget, storage_dir=tmp_path, recompute=True, plan_cache_dir=cache
    ) as mm:
        train(model, mm)
        plan = mm.plan_for(model, inputs=batch(0))
        assert plan is not None and plan.recompute
    script = f"""
import sys, torch
torch.set_num_threads(1)
sys.path.insert(0, {str(Path(__file__).parent)!r})
import vtensor
from recompute_models import Block, model_with, train, assert_same
model = model_with(Block)
with vtensor.MemoryManager({budget}, storage_dir={str(tmp_path)!r}, recompute=True,
                           plan_cache_dir={str(cache)!r}) as mm:
    grads = train(model, mm)
    first = mm.reports[0]
    print(first.plan_source, len(first.recomputed), flush=True)
assert_same(Block, model, grads)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    source, count = done.stdout.split()
    assert source == "cached" and int(count) == len(plan.recompute) > 0


def test_every_replay_form_keeps_bit_identity_under_a_budget_that_never_binds(
    tmp_path: Path,
) -> None:
    model = model_with(Block)
    with vtensor.MemoryManager("1TiB", storage_dir=tmp_path) as mm:
        grads = train(model, mm)
        sources = [(r.plan_source, r.lean) for r in mm.reports]
    assert sources[:3] == [("profiled", False), ("planned", False), ("planned", True)]
    assert_same(Block, model, grads)


def test_a_profiled_step_leaves_the_managers_own_time_out_of_its_compute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE [own time]: each reading made slow; the trace's compute must not grow with them.
    slept = 0.0
    read = LiveBytes.read

    def slow(self: LiveBytes) -> int:
        nonlocal slept
        time.sleep(0.01)
        slept += 0.01
        return read(self)

    monkeypatch.setattr(LiveBytes, "read", slow)
    torch.manual_seed(0)
    layers = [m for _ in range(6) for m in (nn.Linear(64, 64), nn.Tanh())]
    model, x = nn.Sequential(*layers), torch.randn(32, 64)
    with vtensor.MemoryManager(1 << 40, storage_dir=tmp_path, offload_params=False) as mm:
        with mm.step(model, inputs=(x,)):
            model(x).sum().backward()
        trace = mm.trace
    assert trace is not None
    assert slept >= 0.2  # readings at every hook point of the profiled step
    assert sum(s.duration_s for s in trace.steps) < slept / 4
