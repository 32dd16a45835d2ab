"""A profile cuts each backward step into parts at backward nodes (NOTE [backward parts])."""

import copy
from pathlib import Path

import numpy as np
import torch
from torch import nn

import vtensor
from benchmarks.floors import without_parts
from vtensor.planner.lgm import build_lgm, empty_plan, min_budget
from vtensor.planner.memory_model import simulate, step_unmanaged
from vtensor.planner.trace import Trace

MIB = 2**20
NOISE = 256 * 1024  # small heap allocations the heap counter sees besides the tensors
# Wide against the 64 tokens: queries, keys, values and the projection's input (4 MiB each)
# outweigh the attention weights (512 KiB), and two of them are done with before the
# queries-times-keys backward, the step's peak.
WIDTH = 512
LAYERS = 4


class _Attention(nn.Module):
    """Attention written with tensor ops: its backward is one step of several nodes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.scale = width**-0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        weights = ((q @ k.transpose(-2, -1)) * self.scale).softmax(-1)
        return x + self.proj(weights @ v)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(_Attention(WIDTH) for _ in range(LAYERS)), nn.Linear(WIDTH, 8))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 64, WIDTH, generator=g), torch.randint(0, 8, (32, 64), generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _profile(model: nn.Module, budget: int, storage: Path) -> Trace:
    x, y = _batch()
    with vtensor.MemoryManager(budget, storage_dir=storage) as mm:
        with mm.step(model, inputs=(x, y)):
            _loss(model, x, y).backward()  # type: ignore[no-untyped-call]
        assert mm.trace is not None
        return mm.trace


def test_parts_are_recorded_and_the_model_still_covers_the_step(tmp_path: Path) -> None:
    trace = _profile(_model(), 1 << 40, tmp_path)  # nothing moves: every step as it ran
    parted = [s for s in trace.steps if len(s.part_peak_bytes) > 1]
    assert any(s.name == "backward:0.proj" for s in parted), [s.name for s in parted]
    for s in parted:
        assert max(s.part_peak_bytes) == s.unmanaged_peak_bytes
        # Each part's base, its first sample, is within its peak (NOTE [working set at an
        # unpack]); some part's node allocates above its start.
        assert len(s.part_base_bytes) == len(s.part_peak_bytes)
        assert all(0 < b <= p for b, p in zip(s.part_base_bytes, s.part_peak_bytes, strict=True))
    starts = [(s.part_base_bytes, s.part_peak_bytes) for s in parted]
    assert any(b < p for bases, peaks in starts for b, p in zip(bases, peaks, strict=True))
    assert all(not s.part_base_bytes for s in trace.steps if len(s.part_peak_bytes) <= 1)
    for t in trace.tensors:
        if t.last_part >= 0:
            assert t.last_part < len(trace.steps[max(t.use_steps)].part_peak_bytes)
    refined = step_unmanaged(trace)
    plain = np.array([s.unmanaged_peak_bytes for s in trace.steps])
    assert (refined <= plain).all() and (refined < plain).any()
    # With nothing moved, the finer model still holds every step's measured peak.
    predicted = simulate(empty_plan(trace, 1 << 40, trace.chunk_bytes), trace)
    for s, bytes_ in zip(trace.steps, predicted, strict=True):
        assert bytes_ >= s.peak_live_bytes - NOISE, (s.name, bytes_, s.peak_live_bytes)


def test_a_budget_under_the_step_floor_trains_bit_identically(tmp_path: Path) -> None:
    model = _model()
    reference = copy.deepcopy(model)
    x, y = _batch()
    _loss(reference, x, y).backward()  # type: ignore[no-untyped-call]
    trace = _profile(copy.deepcopy(model), 1 << 40, tmp_path)
    coarse = without_parts(trace)
    floor = min_budget(build_lgm(trace, trace.chunk_bytes))[0]
    coarse_floor = min_budget(build_lgm(coarse, coarse.chunk_bytes))[0]
    assert floor < coarse_floor - 2 * MIB
    budget = (floor + coarse_floor) // 2  # under the floor the steps alone would state
    with vtensor.MemoryManager(budget, storage_dir=tmp_path) as mm:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            with mm.step(model, inputs=(x, y)):
                _loss(model, x, y).backward()  # type: ignore[no-untyped-call]
            report = mm.report()
            assert report.peak_device_bytes <= budget + MIB
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                assert p.grad is not None and q.grad is not None
                assert torch.equal(p.grad, q.grad)
    assert report.plan_source != "reactive"
