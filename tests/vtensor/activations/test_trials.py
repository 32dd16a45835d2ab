"""A trial of recomputation keeps the budget (NOTE [recomputed growth])."""

import logging
from pathlib import Path

import pytest
import torch
from recompute_models import Block, batch, only
from torch import nn

import vtensor
import vtensor.activations.planning
from vtensor.planner.trace import Trace

WIDTH = 256
DEEP, SMALL = "5", "6"
CHUNK = 64 * 1024


def _model() -> nn.Module:
    """Blocks that swap, then a deep unit and a small one, both recomputed in the trial."""
    torch.manual_seed(0)
    deep = nn.Sequential(*(m for _ in range(8) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())))
    blocks = [Block(WIDTH) for _ in range(4)]
    return nn.Sequential(nn.Linear(64, WIDTH), *blocks, deep, Block(WIDTH), nn.Linear(WIDTH, 10))


def _steps(model: nn.Module, mm: vtensor.MemoryManager, count: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(count):
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        with mm.step(model, opt, inputs=(x, y)):
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _deep_and_small(trace: Trace, _budget_bytes: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (DEEP, SMALL), ()


def test_a_trial_makes_room_for_what_each_recomputation_brings_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A recomputation brings a unit's saved tensors back at once, between two hook points.
    # In backward the small unit comes back first; the deep one then grows several times the
    # headroom the trial has seen, while the blocks' swapped tensors are being brought back
    # in front of it: unless room is made for it first, it breaks the budget and the candidate
    # is dropped.
    monkeypatch.setattr(vtensor.activations.planning, "recompute_candidates", only(_deep_and_small))
    with vtensor.MemoryManager("1TiB", storage_dir=tmp_path / "free") as probe:
        _steps(_model(), probe, 1)
        budget = int(probe.report().peak_device_bytes * 0.7)
    model = _model()
    with (
        caplog.at_level(logging.WARNING),
        vtensor.MemoryManager(
            budget, storage_dir=tmp_path, recompute=True, chunk_bytes=CHUNK
        ) as mm,
    ):
        _steps(model, mm, 2)  # the profile, then the trial
        trial = mm.report()
    assert trial.plan_source == "profiled" and trial.recomputed == (DEEP, SMALL), trial
    assert trial.peak_device_bytes <= budget + CHUNK, (trial.peak_device_bytes, budget)
    assert "broke the budget" not in caplog.text
