"""Light replay of plans that move nothing (NOTE [light replay] in activations/iteration.py)."""

from pathlib import Path

import torch
from torch import nn

import vtensor

MIB = 1 << 20


class Growing(nn.Module):
    """Blocks whose forward saves several times more once ``grow`` is set."""

    def __init__(self, width: int = 256, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 10)
        self.grow = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
            if self.grow:
                wide = torch.sigmoid(x.repeat(1, 4))  # saved for backward: 4x the activation
                x = x + wide[:, : x.shape[1]] * 1e-3
        return self.head(x)


def _steps(model: Growing, manager: vtensor.MemoryManager | None, grow_at: int, n: int) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    grads = []
    for step in range(n):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(512, 256, generator=g), torch.randint(0, 10, (512,), generator=g)
        model.grow = step >= grow_at
        opt.zero_grad(set_to_none=True)
        if manager is None:
            nn.functional.cross_entropy(model(x), y).backward()
        else:
            with manager.step(model, opt, inputs=(x, y)):
                nn.functional.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        opt.step()
    return grads


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_plan_that_moves_nothing_replays_light_and_bit_identically(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, ref = Growing(), Growing()
    ref.load_state_dict(model.state_dict())
    with vtensor.MemoryManager("1TiB", storage_dir=tmp_path) as mm:
        grads = _steps(model, mm, grow_at=99, n=4)
        assert [r.light for r in mm.reports] == [False, True, True, True]
        assert all(r.peak_device_bytes > 0 for r in mm.reports)
    want = _steps(ref, None, grow_at=99, n=4)
    assert all(_same(s, t) for s, t in zip(want, grads, strict=True))


def test_growth_beyond_the_plan_ends_light_replay_and_the_budget_holds(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, ref = Growing(), Growing()
    ref.load_state_dict(model.state_dict())
    with vtensor.MemoryManager("1TiB", storage_dir=tmp_path) as probe:
        _steps(Growing(), probe, grow_at=2, n=3)
        small, grown = probe.reports[1].peak_device_bytes, probe.reports[2].peak_device_bytes
    # Light for the plain iterations (a fifth of the budget free), too small for the grown
    # ones, which it can still train: the smallest budget a grown iteration states.
    budget = int(small / 0.7)
    try:
        with vtensor.MemoryManager(budget, storage_dir=tmp_path) as trial:
            _steps(Growing(), trial, grow_at=0, n=2)
    except vtensor.InfeasibleBudgetError as err:
        budget = max(budget, err.min_budget_bytes)
    assert budget < grown, (small, grown, budget)
    with vtensor.MemoryManager(budget, storage_dir=tmp_path) as mm:
        grads = _steps(model, mm, grow_at=3, n=5)
        reports = mm.reports
    assert reports[1].light and reports[2].light
    assert not reports[3].light and reports[3].bytes_out > 0  # the guard had to act
    assert all(r.peak_device_bytes <= budget + MIB for r in reports)
    want = _steps(ref, None, grow_at=3, n=5)
    assert all(_same(s, t) for s, t in zip(want, grads, strict=True))
