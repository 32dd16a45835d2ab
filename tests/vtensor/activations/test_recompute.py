"""Recomputation (NOTE [recompute], NOTE [safe to recompute], NOTE [hybrid plan]), whole and
selective (NOTE [selective recompute])."""

import dataclasses
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import vtensor
import vtensor.activations.planning
from vtensor.activations.race import ROUNDS as RACE_ROUNDS
from vtensor.activations.race import PlanRace
from vtensor.activations.recompute import recompute_modules
from vtensor.planner.plan import Plan
from vtensor.planner.recompute import recompute_candidates
from vtensor.planner.trace import Trace, TraceUnit

MIB = 1 << 20
STEPS = 4
_EMPTY_PLAN = Plan(0, None, (), (), (), 0, 0.0, "test")


class Block(nn.Module):
    """A module with children whose inner activations only its own backward uses."""

    def __init__(self, width: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.norm(self.fc(x))))


class InPlaceInput(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(1.0)  # writes its input in place: a second forward would start elsewhere
        return super().forward(x)


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


class CustomFunction(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(Scale.apply(x))


class PythonRandom(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * (1.0 + random.random())  # outside torch's generators


class Counter(Block):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # a side effect a second forward would repeat
        return super().forward(x)


class InputBranch(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y * 2 if bool(x.sum() > 0) else y  # control flow the inputs decide: safe


class ProductInPlace(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.add_(1.0)  # modifies a product output in place: SAC's cached copy would be wrong
        return x + self.drop(torch.tanh(self.norm(h)))


class ProductOut(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.norm(x)))  # a product output leaves it


class Inverted(Block):
    """An inverted residual, as MobileNetV2's: an expansion, an in-place ReLU6, a projection."""

    def __init__(self, width: int, dropout: float = 0.0) -> None:
        super().__init__(width, dropout)
        self.expand = nn.Sequential(
            nn.Linear(width, 2 * width), nn.BatchNorm1d(2 * width), nn.ReLU6(inplace=True)
        )
        self.project = nn.Sequential(nn.Linear(2 * width, width), nn.BatchNorm1d(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.project(self.expand(x))


NOT_SELECTIVE = {
    ProductInPlace: "modifies a product output in place",
    ProductOut: "a product output leaves it",
}

UNSAFE = {
    InPlaceInput: "modifies an input in place",
    CustomFunction: "custom autograd Function",
    PythonRandom: "other outputs",
    Counter: "changes a module attribute",
}


def _model(kind: type[Block], width: int = 256, depth: int = 6, dropout: float = 0.1) -> nn.Module:
    torch.manual_seed(0)
    blocks = [Block(width, dropout) for _ in range(depth)]
    blocks[2] = kind(width, dropout)
    return nn.Sequential(nn.Linear(64, width), *blocks, nn.Linear(width, 10))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(512, 64, generator=g), torch.randint(0, 10, (512,), generator=g)


def _train(model: nn.Module, manager: vtensor.MemoryManager | None) -> list[list[torch.Tensor]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    grads = []
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad(set_to_none=True)
        random.seed(step)
        torch.manual_seed(100 + step)  # dropout
        if manager is None:
            nn.functional.cross_entropy(model(x), y).backward()
        else:
            with manager.step(model, opt, inputs=(x, y)):
                nn.functional.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        opt.step()
    return grads


def _peak(kind: type[Block], tmp_path: Path) -> int:
    with vtensor.MemoryManager("1TiB", storage_dir=tmp_path) as probe:
        _train(_model(kind), probe)
        return max(r.peak_device_bytes for r in probe.reports)


def _hybrid(kind: type[Block], fraction: float, tmp_path: Path, **kw: object) -> tuple:
    budget = int(_peak(kind, tmp_path) * fraction)
    model = _model(kind)
    with vtensor.MemoryManager(budget, storage_dir=tmp_path, recompute=True, **kw) as mm:
        grads = _train(model, mm)
        return model, grads, mm.reports, [u for u in (mm.trace.units if mm.trace else ())]


def _assert_same(kind: type[Block], model: nn.Module, grads: list[list[torch.Tensor]]) -> None:
    ref = _model(kind)
    want = _train(ref, None)
    for step, (a, b) in enumerate(zip(want, grads, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"step {step}"
    for (name, x), y in zip(ref.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(x, y), f"{name} differs (BatchNorm statistics updated twice?)"


def test_recomputed_training_is_bit_identical_with_dropout_and_batchnorm(tmp_path: Path) -> None:
    model, grads, reports, _ = _hybrid(InputBranch, 0.5, tmp_path)
    assert reports[1].recomputed, "the trial iteration recomputed nothing"
    _assert_same(InputBranch, model, grads)
    assert all(r.peak_device_bytes <= r.budget_bytes + MIB for r in reports[1:])


def _profiled_units(kind: type[Block], tmp_path: Path) -> tuple[list[TraceUnit], tuple]:
    budget = int(_peak(kind, tmp_path) * 0.5)
    model = _model(kind)
    with vtensor.MemoryManager(budget, storage_dir=tmp_path, recompute=True) as mm:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        units: list[TraceUnit] = []
        recomputed: list[str] = []
        for step in range(STEPS):
            x, y = _batch(step)
            opt.zero_grad(set_to_none=True)
            with mm.step(model, opt, inputs=(x, y)):
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if mm.trace is not None and mm.trace.units and not units:
                units = list(mm.trace.units)
            recomputed += mm.report().recomputed
    return units, tuple(recomputed)


@pytest.mark.parametrize("kind", list(UNSAFE), ids=lambda k: k.__name__)
def test_a_unit_that_might_not_reproduce_its_forward_is_never_recomputed(
    kind: type[Block], tmp_path: Path
) -> None:
    units, recomputed = _profiled_units(kind, tmp_path)
    by_name = {u.name: u for u in units}
    assert "3" in by_name, f"block 3 (the {kind.__name__}) was not profiled: {sorted(by_name)}"
    assert not by_name["3"].safe and UNSAFE[kind] in by_name["3"].why_unsafe
    assert all(by_name[n].safe for n in ("2", "4") if n in by_name)  # the plain blocks
    assert "3" not in recomputed
    assert recomputed, "the safe blocks should still be recomputed"
    # and what did run stays bit-identical (the unsafe block kept or swapped what it saved)
    if kind is not PythonRandom:  # its outputs depend on Python's RNG, seeded per step
        model, grads, _, _ = _hybrid(kind, 0.5, tmp_path)
        _assert_same(kind, model, grads)


Names = tuple[str, ...]
Choice = Callable[[Trace, int], tuple[Names, Names]]


def _all_selective(trace: Trace, _budget_bytes: int) -> tuple[Names, Names]:
    """A choice that recomputes every unit it may selectively (the top-level blocks)."""
    names = tuple(sorted(u.name for u in trace.units if u.selective_safe and "." not in u.name))
    return names, names


def _only(choice: Choice) -> Callable[[Trace, int], tuple[tuple[Names, Names], ...]]:
    """Candidates for the race: ``choice`` alone."""
    return lambda trace, budget_bytes: (choice(trace, budget_bytes),)


def test_selectively_recomputed_training_is_bit_identical_with_dropout_and_batchnorm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vtensor.activations.planning, "recompute_candidates", _only(_all_selective))
    model, grads, reports, _ = _hybrid(InputBranch, 0.5, tmp_path)
    assert reports[1].selective and reports[1].selective == reports[1].recomputed
    _assert_same(InputBranch, model, grads)
    assert all(r.peak_device_bytes <= r.budget_bytes + MIB for r in reports[1:])


def test_profiling_finds_what_a_selective_recompute_frees_and_keeps(tmp_path: Path) -> None:
    units, _ = _profiled_units(Block, tmp_path)
    block = {u.name: u for u in units}["2"]
    # fc's output (saved by BatchNorm) is a product output: SAC keeps it. tanh's output and
    # dropout's mask are recomputed.
    assert block.selective_safe and not block.why_not_selective
    assert len(block.product_vids) == 1 and len(block.selective_vids) == 2
    assert set(block.product_vids) | set(block.selective_vids) == set(block.inner_vids)
    assert block.selective_s > 0 and block.product_bytes == 0


def test_a_unit_whose_saved_tensors_die_in_turn_may_be_recomputed_selectively(
    tmp_path: Path,
) -> None:
    # The profile's second forward keeps none of what it saves, so a storage freed there can
    # come back at the same address as the next one saved: it must still count as another.
    units, _ = _profiled_units(Inverted, tmp_path)
    block = {u.name: u for u in units}["3"]
    assert block.selective_safe, block.why_not_selective
    assert len(block.product_vids) == 2  # the two linear layers' outputs


@pytest.mark.parametrize("kind", list(NOT_SELECTIVE), ids=lambda k: k.__name__)
def test_a_unit_whose_product_outputs_may_change_is_never_recomputed_selectively(
    kind: type[Block], tmp_path: Path
) -> None:
    units, _ = _profiled_units(kind, tmp_path)
    block = {u.name: u for u in units}["3"]
    assert block.safe, block.why_unsafe  # it may still be recomputed whole
    assert not block.selective_safe and NOT_SELECTIVE[kind] in block.why_not_selective


def test_sac_refuses_a_product_output_modified_in_place(tmp_path: Path) -> None:
    """What the check above prevents: torch raises in backward (or a plan would be wrong)."""

    class Target:
        recomputing = 0

    model = _model(ProductInPlace)
    x, y = _batch(0)
    with (
        recompute_modules(model, ["3"], Target(), selective=["3"]),
        pytest.raises(RuntimeError, match="mutated"),
    ):
        nn.functional.cross_entropy(model(x), y).backward()


class _HybridWins(PlanRace):
    def _best(self) -> int:
        return 0  # the first candidate, the hybrid plan


def test_a_cached_hybrid_plan_trains_bit_identically_in_a_fresh_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Selective units in the plan, replayed from the cache. The race between the hybrid and
    # the swap-only plan is decided by timing (tested above); here the hybrid one wins it.
    # The child runs one intra-op thread, as the suite does (conftest.py). With two, the first
    # tanh of the child's process came out up to 870 ulp off on the calling thread's share in
    # about one run in eight, from identical inputs (docs/vtensor.md, "Recomputation").
    monkeypatch.setattr(vtensor.activations.planning, "recompute_candidates", _only(_all_selective))
    monkeypatch.setattr(vtensor.activations.planning, "PlanRace", _HybridWins)
    cache = tmp_path / "plans"
    budget = int(_peak(Block, tmp_path) * 0.6)
    model = _model(Block)
    with vtensor.MemoryManager(
        budget, storage_dir=tmp_path, recompute=True, plan_cache_dir=cache
    ) as mm:
        _train(model, mm)
        _train(model, mm)  # profiled, trial, the race, then the winner
        assert mm.reports[-1].recomputed
        assert any(r.selective for r in mm.reports)
        plan = mm.plan_for(model, inputs=_batch(0))
        assert plan is not None
    script = f"""
import sys, torch
torch.set_num_threads(1)
sys.path.insert(0, {str(Path(__file__).parent)!r})
import vtensor
from test_recompute import Block, _model, _train, _assert_same
model = _model(Block)
with vtensor.MemoryManager({budget}, storage_dir={str(tmp_path)!r}, recompute=True,
                           plan_cache_dir={str(cache)!r}) as mm:
    grads = _train(model, mm)
    first = mm.reports[0]
    print(first.plan_source, len(first.recomputed), len(first.selective), flush=True)
    assert first.plan_source == "cached", first.plan_source
_assert_same(Block, model, grads)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    source, count, selective = done.stdout.split()
    # The cached plan is the faster of the two tried, with or without recomputation: the child
    # recomputes exactly what it says, in the same modes, from its first iteration.
    assert source == "cached" and int(count) == len(plan.recompute) > 0
    assert int(selective) == len(plan.selective) and set(plan.selective) <= set(plan.recompute)


class Slow(Block):
    """A block whose forward waits: recomputing it costs what swapping its tensors does not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.2)
        return super().forward(x)


def _race(
    model: nn.Module, budget: int, steps: int, tmp_path: Path
) -> tuple[tuple[vtensor.IterationReport, ...], Plan | None]:
    """``steps`` iterations on one batch with recomputation: the reports and the plan kept."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = _batch(0)
    with vtensor.MemoryManager(budget, storage_dir=tmp_path, recompute=True) as mm:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            with mm.step(model, opt, inputs=(x, y)):
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return mm.reports, mm.plan_for(model, inputs=(x, y))


def test_the_hybrid_plan_races_the_swap_only_plan_and_the_faster_replay_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        vtensor.activations.planning, "recompute_candidates", lambda _t, _b: ((("3",), ()),)
    )
    budget = int(_peak(Block, tmp_path) * 0.5)
    model = _model(Slow)
    reports, plan = _race(model, budget, 2 + 2 * RACE_ROUNDS + 1, tmp_path)
    assert [r.plan_source for r in reports[:2]] == ["profiled", "profiled"]
    assert reports[1].recomputed == ("3",)  # the trial, the slow block
    raced = reports[2 : 2 + 2 * RACE_ROUNDS]
    assert [r.recomputed for r in raced] == [("3",), ()] * RACE_ROUNDS  # in turn
    assert all(r.plan_source == "raced" for r in raced)
    # Recomputing the slow block costs 0.2 s a step that swapping its tensors does not.
    walls = [(r.plan_source, r.recomputed, round(r.wall_s, 3)) for r in reports]
    assert plan is not None and plan.recompute == (), walls
    assert reports[-1].recomputed == () and reports[-1].plan_source == "planned"
    # The swap-only replays move what their plan moves: the guard keeps that plan's headroom,
    # not the larger one the trial of recomputation grew (its unit's tensors came back at once).
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = _batch(0)
    with vtensor.MemoryManager(budget, storage_dir=tmp_path) as plain:
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            with plain.step(model, opt, inputs=(x, y)):
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        plain_out = plain.report().bytes_out
    swap_only = [r.bytes_out for r in reports[2:] if not r.recomputed]
    assert all(out <= plain_out for out in swap_only), (swap_only, plain_out)


def test_a_kept_hybrid_plan_the_guard_had_to_help_is_made_again_from_its_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        vtensor.activations.planning, "recompute_candidates", lambda _t, _b: ((("3",), ()),)
    )
    monkeypatch.setattr(PlanRace, "_best", lambda _race: 0)  # the hybrid plan wins the race
    # As if the guard had evicted 256 KiB of its own in every full replay.
    monkeypatch.setattr(vtensor.MemoryManager, "_guard_bytes", lambda *_: 256 * 1024)
    budget = int(_peak(Block, tmp_path) * 0.5)
    model = _model(Block)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = _batch(0)
    plans = []
    with vtensor.MemoryManager(budget, storage_dir=tmp_path, recompute=True) as mm:
        for _ in range(2 + 2 * RACE_ROUNDS + 3):  # profile, trial, race, three replays
            opt.zero_grad(set_to_none=True)
            with mm.step(model, opt, inputs=(x, y)):
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            plans.append(mm.plan_for(model, inputs=(x, y)))
        reports = mm.reports
    kept, margined, *later = plans[-4:]  # the race's winner, then after each replay
    assert [r.plan_source for r in reports[-3:]] == ["planned"] * 3
    assert kept is not None and kept.recompute == ("3",)
    # Made again from the trial's profile, with the same recomputation, 256 KiB further under
    # the budget; and only once.
    assert margined is not None and margined.recompute == kept.recompute
    assert margined.selective == kept.selective
    assert margined.budget_bytes == kept.budget_bytes - 256 * 1024
    assert later == [margined, margined]
    assert reports[-1].recomputed == ("3",)
    assert all(r.peak_device_bytes <= r.budget_bytes + MIB for r in reports)


def test_each_candidate_recomputation_is_profiled_then_all_race_with_the_swap_only_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found: list[tuple[tuple[Names, Names], ...]] = []

    def candidates(trace: Trace, budget_bytes: int) -> tuple[tuple[Names, Names], ...]:
        found.append(recompute_candidates(trace, budget_bytes))
        return found[-1]

    budget = int(_peak(Block, tmp_path) * 0.5)
    monkeypatch.setattr(vtensor.activations.planning, "recompute_candidates", candidates)
    reports, plan = _race(_model(Block), budget, 1 + 2 + 3 * RACE_ROUNDS, tmp_path)
    assert len(found) == 1 and len(found[0]) == 2, found  # the cheapest cover, every block
    (cheapest, _), (outermost, selective) = found[0]
    assert cheapest != outermost and set(selective) == set(outermost) - {"0", "7"}
    assert [r.recomputed for r in reports[1:3]] == [cheapest, outermost]  # the two trials
    raced = reports[3:]
    assert all(r.plan_source == "raced" for r in raced)
    assert [r.recomputed for r in raced] == [cheapest, outermost, ()] * RACE_ROUNDS
    best = {
        names: min(r.wall_s for r in raced if r.recomputed == names)
        for names in (cheapest, outermost, ())
    }
    assert plan is not None and plan.recompute == min(best, key=best.__getitem__)
    assert all(r.peak_device_bytes <= r.budget_bytes + MIB for r in reports)


def test_a_trial_that_breaks_the_budget_gives_way_to_the_next_candidate_then_to_swapping() -> None:
    from vtensor.activations.iteration_plan import IterationPlan, Trials
    from vtensor.activations.planning import PlanBook
    from vtensor.activations.report import PlanSource

    book = PlanBook(1 << 20, None, None, recompute=True)
    swap_only = dataclasses.replace(_EMPTY_PLAN, planner="swap only")
    book._trial["sig"] = Trials([(("a",), ()), (("b",), ("b",))], [], swap_only)

    def trial() -> IterationPlan:
        names, selective = book._trial["sig"].pending[0]
        return IterationPlan(
            "sig", PlanSource.PROFILED, None, True, None, recompute=names, selective=selective
        )

    first = trial()
    assert first.recompute == ("a",) and book.excuse(first, was_lean=False) and first.abandoned
    second = trial()
    assert second.recompute == ("b",) and book.excuse(second, was_lean=False)
    assert "sig" not in book._trial and book._plans["sig"] is swap_only  # swapping only
    assert not book.excuse(IterationPlan("sig", PlanSource.PLANNED, None, False, None), False)


def test_a_race_keeps_the_plan_with_the_least_best_time() -> None:
    a, b = (dataclasses.replace(_EMPTY_PLAN, recompute=names) for names in (("x",), ()))
    race = PlanRace([a, b])
    times = [1.0, 2.0, 5.0, 1.5]  # a, b, a, b: a's best 1.0 beats b's best 1.5
    results = [race.record(t) for t in times[:-1]]
    assert results == [None] * 3 and race.current() is b
    assert race.record(times[-1]) is a
    assert race.best_times() == [1.0, 1.5]
