"""The tracked peak includes what a backward node holds at once (NOTE [node peaks] in hooks.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import vtensor
from vtensor.activations.runtime.hooks import _NodeSampler
from vtensor.measure.dispatch import LiveStorageTracker

MIB = 2**20


class _ExpChain(nn.Module):
    """Backward nodes whose saved result, incoming and outgoing gradients coexist (3 x 4 MiB).

    The manager's other hook points (an unpack, a module boundary) come before the node
    allocates its output or after the engine has freed its input: only a node post-hook sees
    all three.
    """

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.exp(x * self.scale)
        h = torch.exp(h * 0.5)
        h = torch.exp(h * 0.5)
        return h * h


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Nodes made after the model's output (the loss) are sampled at hook points only.
    out: torch.Tensor = model(x)
    return out.mean()


def _input() -> torch.Tensor:
    return torch.rand(1 << 20, generator=torch.Generator().manual_seed(0))


def _managed_peak(model: nn.Module, x: torch.Tensor, budget: int | str) -> int:
    with vtensor.MemoryManager(budget, policy="reactive") as mm:
        for _ in range(2):  # the first iteration of a process also sets up kernel caches
            model.zero_grad(set_to_none=True)
            with mm.step(model, inputs=(x,)):
                _loss(model, x).backward()  # type: ignore[no-untyped-call]
        return mm.report().peak_device_bytes


def _independent_peak(model: nn.Module, x: torch.Tensor) -> int:
    model.zero_grad(set_to_none=True)
    tracker = LiveStorageTracker()
    tracker.track(*model.parameters(), x)
    with tracker:
        _loss(model, x).backward()  # type: ignore[no-untyped-call]
    return tracker.peak_bytes


def test_tracked_peak_includes_backward_node_working_sets() -> None:
    model, x = _ExpChain(), _input()
    independent = _independent_peak(model, x)
    tracked = _managed_peak(model, x, "1GiB")
    # The heap counter also sees small non-tensor allocations, so tracked may be a little higher.
    assert tracked >= independent - 256 * 1024
    assert tracked <= independent + 2 * MIB


def test_node_working_sets_were_missed_without_node_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = _ExpChain(), _input()
    independent = _independent_peak(model, x)
    monkeypatch.setattr(_NodeSampler, "add_graph_of", lambda self, tensors: None)
    tracked = _managed_peak(model, x, "1GiB")
    assert tracked < independent - 3 * MIB  # one node's output of 4 MiB was not seen


def test_budget_below_a_node_working_set_raises_with_that_minimum() -> None:
    # The backward of ``h * h`` holds the input x, the saved h, the incoming gradient and two
    # outgoing ones (5 x 4 MiB) whatever is swapped out; every other hook point needs less.
    model, x = _ExpChain(), _input()
    with pytest.raises(vtensor.InfeasibleBudgetError) as info:
        _managed_peak(model, x, 16 * MIB)
    assert info.value.min_budget_bytes >= 20 * MIB - 256 * 1024


def test_node_hooks_keep_gradients_bit_identical() -> None:
    model, x = _ExpChain(), _input()
    _loss(model, x).backward()  # type: ignore[no-untyped-call]
    expected = model.scale.grad.clone()  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    _managed_peak(model, x, "1GiB")
    assert torch.equal(model.scale.grad, expected)  # type: ignore[arg-type]


class _CheckpointedBlocks(nn.Module):
    """Blocks under non-reentrant checkpointing: their forward is recomputed inside backward."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)) for _ in range(8)
        )
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpointed:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x


def test_node_hooks_keep_checkpointing_savings() -> None:
    # NOTE [sampled nodes]: hooking the recomputed graphs must not keep their tensors alive.
    x = torch.rand(2048, 256, generator=torch.Generator().manual_seed(0))  # 2 MiB activations
    plain = _managed_peak(_CheckpointedBlocks(checkpointed=False), x, "1GiB")
    checkpointed = _managed_peak(_CheckpointedBlocks(checkpointed=True), x, "1GiB")
    # Without checkpointing 8 blocks keep 3 activations each; with it, the block inputs and
    # one block's recomputed activations.
    assert checkpointed < plain - 16 * MIB


_WORKSPACE_PROBE = """
import torch, vtensor
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 32, 5, padding=2), nn.ReLU(), nn.Conv2d(32, 32, 5))
x = torch.randn(16, 3, 64, 64)
with vtensor.MemoryManager("1GiB", policy="reactive", count_workspaces=True) as mm:
    with mm.step(model, inputs=(x,)):
        model(x).sum().backward()
    # The policy's transient is what it keeps free for workspaces; it has no public view.
    print(mm.report().plan_source, mm._policy.transient_bytes)
"""


def test_reactive_policy_measures_workspaces_when_counting_them() -> None:
    # Workspaces are measured from RSS, which follows the heap only when glibc was started
    # with a low mmap threshold (NOTE [honest RSS]): a fresh process.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(vtensor.__file__).parents[1]), *sys.path])
    done = subprocess.run(
        [sys.executable, "-c", _WORKSPACE_PROBE], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    source, transient = done.stdout.split()
    assert source == "reactive"
    assert int(transient) > 1 * MIB
