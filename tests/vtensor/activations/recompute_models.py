"""Models and helpers of the recomputation and hybrid-plan tests (a block, its unsafe kinds)."""

import dataclasses
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import vtensor
from vtensor.activations.plan.decision import PlanBook, Profile, Stage
from vtensor.activations.plan.iteration_plan import NO_RECOMPUTATION, Recomputation
from vtensor.planner.plan import Plan
from vtensor.planner.recompute import recompute_candidates
from vtensor.planner.trace import Trace

MIB = 1 << 20
STEPS = 4


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


UNSAFE = {
    InPlaceInput: "modifies an input in place",
    CustomFunction: "custom autograd Function",
    PythonRandom: "other outputs",
    Counter: "changes a module attribute",
}


def model_with(
    kind: type[Block], width: int = 256, depth: int = 6, dropout: float = 0.1
) -> nn.Module:
    torch.manual_seed(0)
    blocks = [Block(width, dropout) for _ in range(depth)]
    blocks[2] = kind(width, dropout)
    return nn.Sequential(nn.Linear(64, width), *blocks, nn.Linear(width, 10))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(512, 64, generator=g), torch.randint(0, 10, (512,), generator=g)


def train(model: nn.Module, manager: vtensor.MemoryManager | None) -> list[list[torch.Tensor]]:
    grads: list[list[torch.Tensor]] = []
    for _ in train_steps(model, manager, grads, STEPS):
        pass
    return grads


def train_steps(
    model: nn.Module,
    manager: vtensor.MemoryManager | None,
    grads: list[list[torch.Tensor]],
    count: int,
) -> Iterator[None]:
    """``train``'s steps, one per ``next`` (to interleave managers), each step's gradients kept."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for step in range(count):
        x, y = batch(step)
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
        yield


def managed_steps(
    mm: vtensor.MemoryManager, model: nn.Module, count: int, momentum: float = 0.0
) -> None:
    """``count`` SGD steps of ``model`` under ``mm``, on ``batch(step)``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=momentum)
    for step in range(count):
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        with mm.step(model, opt, inputs=(x, y)):
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def peak_bytes(kind: type[Block], tmp_path: Path) -> int:
    with vtensor.MemoryManager("1TiB", storage_dir=tmp_path) as probe:
        train(model_with(kind), probe)
        return max(r.peak_device_bytes for r in probe.reports)


# At half their peak these models' parameters, gradients and momentum take more than half the
# budget, where a manager would offload them (NOTE [offload auto] in ``offload/joint.py``) and
# plan them jointly, which recomputes nothing: the recomputation tests keep them in memory.
KEEP_PARAMS = False


def hybrid_run(kind: type[Block], fraction: float, tmp_path: Path, **kw: object) -> tuple:
    budget = int(peak_bytes(kind, tmp_path) * fraction)
    model = model_with(kind)
    kw.setdefault("offload_params", KEEP_PARAMS)
    with vtensor.MemoryManager(budget, storage_dir=tmp_path, recompute=True, **kw) as mm:
        grads = train(model, mm)
        return model, grads, mm.reports, [u for u in (mm.trace.units if mm.trace else ())]


def assert_same(kind: type[Block], model: nn.Module, grads: list[list[torch.Tensor]]) -> None:
    ref = model_with(kind)
    want = train(ref, None)
    for step, (a, b) in enumerate(zip(want, grads, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"step {step}"
    for (name, x), y in zip(ref.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(x, y), f"{name} differs (BatchNorm statistics updated twice?)"


Names = tuple[str, ...]
Choice = Callable[[Trace, int], Names]


def first_candidate(trace: Trace, budget_bytes: int) -> Names:
    """The planner's first candidate recomputation at ``budget_bytes`` (none: nothing)."""
    candidates = recompute_candidates(trace, budget_bytes)
    return candidates[0] if candidates else ()


def recomputing(
    monkeypatch: pytest.MonkeyPatch, choice: Choice = first_candidate, keep: bool = False
) -> None:
    """Make every decision's solver pick ``choice`` (NOTE [one decision] in plan/decision.py).

    The profile's choice is what its reprofile recomputes; with ``keep``, the validating
    replay keeps the plan it replayed (else the corrected model may plan swapping alone).
    """

    def solve(book: PlanBook, profile: Profile, _plan: Plan | None) -> Recomputation:
        trace = profile[0]
        if not trace.units:
            return NO_RECOMPUTATION
        names = choice(trace, book.budget_bytes)
        return Recomputation.of(trace, names) if names else NO_RECOMPUTATION

    monkeypatch.setattr(PlanBook, "_solve", solve)
    if keep:
        monkeypatch.setattr(
            PlanBook,
            "_validated",
            lambda _book, decision, *_: dataclasses.replace(decision, stage=Stage.DECIDED),
        )
