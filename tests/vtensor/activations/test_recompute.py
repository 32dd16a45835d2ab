"""Recomputation (NOTE [recompute], NOTE [safe to recompute]). The decision that recomputes:
test_decision.py."""

import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from recompute_models import (
    KEEP_PARAMS,
    MIB,
    STEPS,
    UNSAFE,
    Block,
    InputBranch,
    PythonRandom,
    assert_same,
    batch,
    first_candidate,
    hybrid_run,
    model_with,
    peak_bytes,
    recomputing,
)
from torch import nn

import vtensor
from vtensor.activations.recompute.checkpointed import recompute_modules
from vtensor.activations.recompute.profile.checks import same_bits
from vtensor.planner.recompute import recompute_candidates
from vtensor.planner.trace import Trace, TraceUnit


def test_recomputed_training_is_bit_identical_with_dropout_and_batchnorm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recomputing(monkeypatch, first_candidate, keep=True)  # the planner's first candidate
    model, grads, reports, _ = hybrid_run(InputBranch, 0.5, tmp_path)
    assert reports[1].recomputed, "the reprofile recomputed nothing"
    assert_same(InputBranch, model, grads)
    assert all(r.peak_device_bytes <= r.budget_bytes + MIB for r in reports[1:])


def _profiled_units(kind: type[Block], tmp_path: Path) -> tuple[list[TraceUnit], tuple]:
    budget = int(peak_bytes(kind, tmp_path) * 0.5)
    model = model_with(kind)
    with vtensor.MemoryManager(
        budget, storage_dir=tmp_path, recompute=True, offload_params=KEEP_PARAMS
    ) as mm:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        units: list[TraceUnit] = []
        recomputed: list[str] = []
        for step in range(STEPS):
            x, y = batch(step)
            opt.zero_grad(set_to_none=True)
            with mm.step(model, opt, inputs=(x, y)):
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if mm.trace is not None and mm.trace.units and not units:
                units = list(mm.trace.units)
            recomputed += mm.report().recomputed
    return units, tuple(recomputed)


def _never_block_3(trace: Trace, budget_bytes: int) -> tuple[str, ...]:
    """The first candidate, once no candidate the planner offers names block 3."""
    candidates = recompute_candidates(trace, budget_bytes)
    assert candidates and not any("3" in names for names in candidates), candidates
    return candidates[0]


@pytest.mark.parametrize("kind", list(UNSAFE), ids=lambda k: k.__name__)
def test_a_unit_that_might_not_reproduce_its_forward_is_never_recomputed(
    kind: type[Block], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The solver is made to recompute (NOTE [one decision]): whatever the measured times, the
    # candidates it chooses among never hold the unsafe block.
    recomputing(monkeypatch, _never_block_3, keep=True)
    units, recomputed = _profiled_units(kind, tmp_path)
    by_name = {u.name: u for u in units}
    assert "3" in by_name, f"block 3 (the {kind.__name__}) was not profiled: {sorted(by_name)}"
    assert not by_name["3"].safe and UNSAFE[kind] in by_name["3"].why_unsafe
    assert all(by_name[n].safe for n in ("2", "4") if n in by_name)  # the plain blocks
    assert "3" not in recomputed
    assert recomputed, "the safe blocks should still be recomputed"
    # and what did run stays bit-identical (the unsafe block kept or swapped what it saved)
    if kind is not PythonRandom:  # its outputs depend on Python's RNG, seeded per step
        model, grads, _, _ = hybrid_run(kind, 0.5, tmp_path)
        assert_same(kind, model, grads)


@pytest.mark.parametrize("name", ["9", "3.weight", "3.nothing"])
def test_a_plan_naming_no_module_of_the_model_is_refused_untouched(name: str) -> None:
    # A plan of another model (a cache shared by mistake) names a module this one lacks, or a
    # path that ends at a parameter: the step refuses it and no module keeps a wrapper.
    model = model_with(Block)
    refused = rf"\['{re.escape(name)}'\].*clear the plan cache"
    with (
        pytest.raises(vtensor.VTensorError, match=refused),
        recompute_modules(model, ["1", name], None),  # type: ignore[arg-type]
    ):
        pass
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_torch_frees_each_recomputed_tensor_after_its_use_as_the_planner_models() -> None:
    # NOTE [recomputed lifetimes] in planner/recompute.py: with_recompute holds a recomputed
    # tensor from the unit's first backward step through its own last use, as torch's
    # checkpoint does (a weak reference keyed by a handle dropped at unpack). Should torch keep
    # them all through the unit's backward, the planner would under-count its working set.
    from torch.utils.checkpoint import checkpoint

    from vtensor.measure.counter import make_device_tracker

    tracker, nbytes = make_device_tracker(torch.device("cpu")), 16 * MIB
    readings: dict[str, int] = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, tag: str) -> torch.Tensor:
            ctx.tag = tag
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            readings[ctx.tag] = tracker.current_bytes()
            return grad, None

    def unit(x: torch.Tensor) -> torch.Tensor:
        a = Probe.apply(torch.sin(x), "a")
        b = Probe.apply(torch.sin(a), "b")
        return torch.sin(b)

    x = torch.randn(nbytes // 4, requires_grad=True)
    checkpoint(unit, x, use_reentrant=False).sum().backward()
    # Probe "b" runs once the last sin's backward has used the recomputed b; probe "a" once the
    # middle sin's backward has used the recomputed a (a's gradient made, b's gradient freed):
    # the 16 MiB fewer are the recomputed a, freed after its use, not at the unit's end.
    assert readings["a"] <= readings["b"] - nbytes + MIB, readings


class _Slow(nn.Module):
    """A leaf that takes at least ``SLOW_S`` (not a unit: it has no children)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLOW_S)
        return x * 1.0


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.slow, self.fc2 = nn.Linear(64, 64), _Slow(), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc2(torch.tanh(self.slow(self.fc1(x)))))


SLOW_S = 0.02


def test_a_units_forward_time_leaves_out_the_checks_of_the_units_inside_it(
    tmp_path: Path,
) -> None:
    # NOTE [safe to recompute]: profiling runs each safe unit's forward twice more (the check,
    # then its second timing: NOTE [unit time]) as it ends. Those runs are left out of the
    # step's time, and must be left out of the forward time of every unit around it too:
    # recomputing the outer unit runs its forward once, not its inner units' checks. Counted
    # in, the outer unit's time was three times its forward, and the planner ranked it (and
    # every unit with units inside it) as dearer to recompute than it is.
    model = nn.Sequential(nn.Linear(32, 64), nn.Sequential(_Inner(), _Inner()), nn.Linear(64, 10))
    x, y = torch.randn(256, 32), torch.randint(0, 10, (256,))
    with vtensor.MemoryManager(1 << 30, storage_dir=tmp_path, recompute=True) as mm:
        with mm.step(model, None, inputs=(x, y)):
            nn.functional.cross_entropy(model(x), y).backward()
        assert mm.trace is not None
        units = {u.name: u for u in mm.trace.units}
    inner = units["1.0"].forward_s + units["1.1"].forward_s
    assert units["1.0"].safe and units["1.1"].safe and units["1"].safe
    assert min(units["1.0"].forward_s, units["1.1"].forward_s) >= SLOW_S
    # Its own forward is its two inner units' and a little Python; their checks would add
    # four more runs of SLOW_S each (2x ``inner``).
    assert units["1"].forward_s < inner + 2 * SLOW_S, (units["1"].forward_s, inner)


class _Counted(nn.Module):
    """The blocks in one unit, its forward calls counted."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(4)))
        self.calls: list[None] = []  # not a plain attribute: the checks look past it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(None)
        return torch.tanh(self.blocks(x))  # saves its output: a unit of its own


def test_a_unit_whose_forward_holds_more_than_the_budget_leaves_is_not_checked(
    tmp_path: Path,
) -> None:
    # Recomputing a unit holds what its forward held (NOTE [recomputation's working set]) on
    # top of the bytes the iteration began with: where that is over the budget, it is never an
    # option, and running its forward again twice, after making room for all it held,
    # is work for nothing (NOTE [safe to recompute]).
    width = 512
    x, y = torch.randn(512, width), torch.randint(0, 10, (512,))

    def step(mm: vtensor.MemoryManager, model: nn.Module) -> None:
        with mm.step(model, None, inputs=(x, y)):
            nn.functional.cross_entropy(model(x), y).backward()

    torch.manual_seed(0)
    model = nn.Sequential(_Counted(width), nn.Linear(width, 10))
    with vtensor.MemoryManager("1TiB", storage_dir=tmp_path / "free", recompute=True) as free:
        step(free, model)
        assert free.trace is not None
        whole = {u.name: u for u in free.trace.units}["0"]
        baseline = free.trace.baseline_bytes
    calls = model[0].calls
    assert whole.safe and len(calls) == 3  # its forward, the check's two
    budget = baseline + whole.working_bytes * 3 // 4
    calls.clear()
    with vtensor.MemoryManager(budget, storage_dir=tmp_path, recompute=True) as mm:
        step(mm, model)
        assert mm.trace is not None
        units = {u.name: u for u in mm.trace.units}
        assert mm.report().peak_device_bytes <= budget + MIB
    assert len(calls) == 1, len(calls)
    assert not units["0"].safe and "budget" in units["0"].why_unsafe, units["0"].why_unsafe
    assert all(units[f"0.blocks.{i}"].safe for i in range(4)), units


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex128]
)
def test_outputs_are_compared_bit_for_bit(dtype: torch.dtype) -> None:
    # NOTE [safe to recompute]: a NaN is the same output as itself; -0.0 is not 0.0.
    a = torch.tensor([0.0, float("nan"), 1.5, -2.0]).to(dtype)
    assert same_bits(a, a.clone()) and same_bits(a[::2], a[::2].clone())  # strided too
    b = a.clone()
    b[0] = -0.0
    assert not same_bits(a, b)
    assert not same_bits(
        a, a.to(torch.complex64 if dtype.is_complex else torch.float32).to(dtype)[:3]
    )


class _Residual(nn.Module):
    """A wrapper around its body; ``own`` saves a tensor of its own after it."""

    def __init__(self, width: int, own: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        self.own = own
        self.calls: list[None] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(None)
        out = x + self.body(x)  # the add saves nothing
        return torch.sigmoid(out) if self.own else out


def test_a_wrapper_that_saves_what_its_body_does_is_no_unit_of_its_own(tmp_path: Path) -> None:
    # NOTE [one unit per tensors]: recomputed, it frees what its body does, for more time.
    width = 128
    model = nn.Sequential(_Residual(width, own=False), _Residual(width, own=True))
    x = torch.randn(64, width)
    with vtensor.MemoryManager("1TiB", storage_dir=tmp_path, recompute=True) as mm:
        with mm.step(model, None, inputs=(x,)):
            model(x).sum().backward()
        assert mm.trace is not None
        units = {u.name: u for u in mm.trace.units}
    assert "0" not in units and units["0.body"].safe, sorted(units)
    assert len(model[0].calls) == 1  # not run again by checks
    assert units["1"].safe and units["1.body"].safe  # its sigmoid saves its output
    assert len(model[1].calls) == 3  # its forward, the check's two
