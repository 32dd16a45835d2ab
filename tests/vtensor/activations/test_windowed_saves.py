"""Windowed saves (NOTE [windowed saves]): saved-tensor hooks only around what the plan moves."""

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from recompute_models import Block, Names, batch, model_with, peak_bytes
from test_hybrid_plan import _HybridWins
from test_lean_replay import CHUNK, Hoarder, _peak, _step
from torch import nn
from torch.utils.checkpoint import checkpoint

import vtensor
import vtensor.activations.planning
import vtensor.activations.wiring as wiring
from vtensor.activations.quiet import QUIET_RUN
from vtensor.activations.windows import SaveWindows, windows_of
from vtensor.planner.trace import Trace


@pytest.fixture
def packs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The saves that reach the manager's pack hook, counted per iteration (one cell)."""
    count = [0]
    made = wiring.make_saved_tensor_hooks

    def spied(target: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
        pack, unpack = made(target)

        def counted(tensor: torch.Tensor) -> Any:
            count[0] += 1
            return pack(tensor)

        return counted, unpack

    monkeypatch.setattr(wiring, "make_saved_tensor_hooks", spied)
    return count


def _windows(mm: vtensor.MemoryManager, model: nn.Module, x: torch.Tensor) -> SaveWindows | None:
    plan = mm.plan_for(model, (x,))
    assert plan is not None
    return mm._quiet._windows.get(plan.digest())


def _windowed(
    model: nn.Module, x: torch.Tensor, tmp_path: Path, packs: list[int]
) -> tuple[SaveWindows, list[int]]:
    """Managed steps at 60 % of the peak, each bit-identical to the unmanaged one.

    Checks that the sparse replays between the checks hook fewer saves than the checks, and
    that every lean replay follows its plan within the budget. The windows and, per lean
    replay, the saves hooked.
    """
    ref = _step(model, x, None)
    budget = int(0.6 * _peak(model, x))
    hooked, reports = [], []
    with vtensor.MemoryManager(budget, chunk_bytes=CHUNK, storage_dir=tmp_path) as mm:
        for step in range(3 + 2 * (QUIET_RUN + 1)):
            packs[0] = 0
            assert all(map(torch.equal, ref, _step(model, x, mm))), f"step {step}"
            hooked.append(packs[0])
            reports.append(mm.report())
        windows = _windows(mm, model, x)
    assert windows is not None
    first = next(i for i, r in enumerate(reports) if r.lean)
    for report in reports[first:]:
        assert report.lean and report.plan_source == "planned"
        assert report.bytes_out > 0 and report.peak_device_bytes <= budget + CHUNK
    # The first lean replay checks every save; the sparse ones after it only their windows'.
    assert min(hooked[first + 1 :]) < hooked[first], hooked
    return windows, hooked[first:]


def test_a_sparse_replay_hooks_only_the_saves_inside_its_windows(
    tmp_path: Path, packs: list[int]
) -> None:
    torch.manual_seed(0)
    model, x = Hoarder(), torch.randn(4096, 64)
    windows, hooked = _windowed(model, x, tmp_path, packs)
    full, later = hooked[0], hooked[1:]
    assert max(later) == full, hooked  # the next check
    assert later.count(min(later)) >= 2 * (QUIET_RUN - 1), hooked
    # Every window is a call of one of the model's modules that saves what the plan moves.
    names = {name for name, _ in model.named_modules() if name}
    assert {name for name, _ in windows.calls} <= names
    assert len(windows.order) < min(later) + 1


def test_windows_are_the_innermost_calls_around_the_moved_saves() -> None:
    a, b, c = ("a", 0), ("a.b", 0), ("c", 0)
    events = [
        (0, (a,)),  # in a, outside its child b: not moved
        (1, (a, b)),  # moved, inside b: b is its window
        (2, ()),  # outside every call
        (3, (c,)),  # moved: c is a window
        (2, (c,)),  # 2 again, now inside a window: placed here, after 3
        (1, (c,)),  # 1 again (moved), inside c
    ]
    found = windows_of(events, moved={1, 3})
    assert found == SaveWindows(frozenset({b, c}), (1, 3, 2))
    # A moved storage saved outside every call (by the loss, after the model): no windows.
    assert windows_of([*events, (3, ())], moved={1, 3}) is None
    assert windows_of(events, moved=set()) is None


class TwoStages(nn.Module):
    """Two hoarders, called one after the other by the training step, not by a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Hoarder(), Hoarder()


def _two_stages(model: TwoStages, x: torch.Tensor, mm: vtensor.MemoryManager | None) -> Any:
    model.zero_grad(set_to_none=True)
    with mm.step(model, inputs=(x,)) if mm is not None else contextlib.nullcontext():
        # ``sin`` saves the first stage's output again, outside every module call.
        model.second(torch.sin(model.first(x))).square().mean().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_a_moved_storage_saved_outside_every_module_keeps_the_hooks_for_the_whole_step(
    tmp_path: Path, packs: list[int]
) -> None:
    torch.manual_seed(0)
    model, x = TwoStages(), torch.randn(4096, 64)
    ref = _two_stages(model, x, None)
    with vtensor.MemoryManager(_peak(model.second, x), storage_dir=tmp_path) as mm:
        hooked, reports = [], []
        for _ in range(3 + QUIET_RUN):
            packs[0] = 0
            assert all(map(torch.equal, ref, _two_stages(model, x, mm)))
            hooked.append(packs[0])
            reports.append(mm.report())
        plan = mm.plan_for(model, (x,))
        assert plan is not None and plan.moves
        assert mm._quiet._windows.get(plan.digest(), "none") is None
    first = next(i for i, r in enumerate(reports) if r.lean)
    assert all(r.lean and r.plan_source == "planned" for r in reports[first:])
    assert set(hooked[first:]) == {hooked[first]}, hooked


class Checkpointed(nn.Module):
    """A block whose forward runs its layers under torch's non-reentrant checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.inner, x, use_reentrant=False)
        return out


def test_windows_stay_outside_contexts_a_module_pushes(tmp_path: Path, packs: list[int]) -> None:
    # The checkpointed blocks' layers run under checkpointing's own saved-tensor hooks: no
    # window can be pushed under them, and the plan's moves around them keep their windows.
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(8):
        layers.append(Checkpointed() if i % 3 == 1 else nn.Sequential(nn.Linear(64, 64), nn.Tanh()))
    model, x = nn.Sequential(*layers), torch.randn(4096, 64)
    windows, _ = _windowed(model, x, tmp_path, packs)
    inside = {name for name, m in model.named_modules() if ".inner" in name}
    assert not {name for name, _ in windows.calls} & inside


def _one_block(trace: Trace, _budget_bytes: int) -> tuple[tuple[Names, Names], ...]:
    """One whole block recomputed; the plan swaps whatever the budget still needs."""
    return (((next(u.name for u in trace.units if u.safe and "." not in u.name),), ()),)


def test_a_plan_that_recomputes_and_swaps_replays_windowed_bit_identically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, packs: list[int]
) -> None:
    # Dropout inside the blocks (its RNG state restored for the recomputation), one block
    # behind one node, the rest swapped between the windows' saves.
    monkeypatch.setattr(vtensor.activations.planning, "recompute_candidates", _one_block)
    monkeypatch.setattr(vtensor.activations.planning, "PlanRace", _HybridWins)
    budget = int(peak_bytes(Block, tmp_path) * 0.5)
    runs, hooked = [], []
    for manager in (None, vtensor.MemoryManager(budget, storage_dir=tmp_path, recompute=True)):
        model = model_with(Block)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        grads = []
        for step in range(4 + 2 * (QUIET_RUN + 1)):
            x, y = batch(step % 2)  # two batches of one signature: the plan is replayed
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)  # dropout
            packs[0] = 0
            with manager.step(model, opt, (x, y)) if manager else contextlib.nullcontext():
                nn.functional.cross_entropy(model(x), y).backward()
            if manager is not None:
                hooked.append((packs[0], manager.report()))
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
            opt.step()
        if manager is not None:
            plan = manager.plan_for(model, inputs=batch(0))
            windows = manager._quiet._windows.get(plan.digest()) if plan else None
            manager.close()
            assert plan is not None and plan.recompute and plan.moves
            assert windows is not None
        runs.append(grads)
    for want, got in zip(*runs, strict=True):
        assert all(map(torch.equal, want, got))
    lean = [n for n, report in hooked if report.lean and report.recomputed]
    assert min(lean) < max(lean), lean  # windowed replays among the checking ones
    first = next(i for i, (_, r) in enumerate(hooked) if r.lean)
    # No replay left its plan (a race's replays are "raced").
    assert all(r.plan_source != "fallback" and r.bytes_out for _, r in hooked[first:])
    assert all(r.peak_device_bytes <= budget + (1 << 20) for _, r in hooked[-QUIET_RUN:])


class Shared(nn.Module):
    """One layer called at two places of the forward, each call a window of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.shared(x)
        for layer in self.layers[:3]:
            x = layer(x)
        x = self.shared(x)
        for layer in self.layers[3:]:
            x = layer(x)
        return x


def test_windows_count_the_calls_of_a_module_called_at_two_places(
    tmp_path: Path, packs: list[int]
) -> None:
    torch.manual_seed(0)
    model, x = Shared(), torch.randn(4096, 64)
    windows, _ = _windowed(model, x, tmp_path, packs)
    # The shared layer's calls are told apart: its second call is a window of its own.
    assert any(call == 1 for name, call in windows.calls if name.startswith("shared"))


class Reuser(Hoarder):
    """The hoarder, whose forward can use each layer's output again between the layers."""

    reuse = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            if self.reuse:
                x = x * torch.sigmoid(x)  # saves ``x`` again, outside every window
        return x


def test_a_moved_storage_saved_again_outside_the_windows_stays_put(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, packs: list[int]
) -> None:
    windowed: list[bool] = []  # per sparse replay (no check): whether it had windows
    made = wiring.WindowedSaves

    def spied(*args: Any) -> Any:
        windowed.append(True)
        return made(*args)

    monkeypatch.setattr(wiring, "WindowedSaves", spied)
    torch.manual_seed(0)
    model, x = Reuser(), torch.randn(4096, 64)
    budget = int(0.6 * _peak(model, x))
    with vtensor.MemoryManager(budget, chunk_bytes=CHUNK, storage_dir=tmp_path) as mm:
        for _ in range(3 + QUIET_RUN):
            _step(model, x, mm)
        assert _windows(mm, model, x) is not None
        # The run changes: the storages the plan moves are also saved by ops outside every
        # window, whose saved tensors autograd holds. Those references pin them: the plan's
        # evictions of them are not issued, and the gradients stay exact.
        model.reuse = True
        want = _step(model, x, None)
        windowed.clear()
        got = _step(model, x, mm)
    assert windowed == [True]  # a windowed replay
    assert all(map(torch.equal, want, got))
