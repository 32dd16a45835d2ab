"""What a step costs outside the model: one look at the model's structure, no hooks left on it."""

from pathlib import Path

import torch
from torch import nn
from torch.nn.modules import module as torch_module

import vtensor
import vtensor.activations.model_state


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64), nn.Tanh())


def _step(mm: vtensor.MemoryManager, model: nn.Module, x: torch.Tensor) -> None:
    with mm.step(model, inputs=(x,)):
        model(x).sum().backward()


def test_a_manager_fingerprints_an_unchanged_model_once(tmp_path: Path, monkeypatch):
    prints: list[int] = []
    fingerprint = vtensor.activations.model_state.architecture_fingerprint

    def counted(model: nn.Module) -> str:
        prints.append(1)
        return fingerprint(model)

    monkeypatch.setattr(vtensor.activations.model_state, "architecture_fingerprint", counted)
    torch.manual_seed(0)
    model, x = _model(), torch.randn(512, 64)
    with vtensor.MemoryManager("1GiB", storage_dir=tmp_path) as mm:
        for _ in range(4):
            _step(mm, model, x)
        assert len(prints) == 1
        model[2] = nn.Linear(256, 64)  # another module, of the same class and shape
        _step(mm, model, x)
        assert len(prints) == 2
        model[0].weight.requires_grad_(False)  # what autograd saves changes
        _step(mm, model, x)
        assert len(prints) == 3
        model[0].weight.requires_grad_(True)
        assert mm.plan_for(model, (x,)) is not None  # the plan of the first structure
        model[0] = nn.Linear(64, 128)  # another shape: another plan
        model[2] = nn.Linear(128, 64)
        assert mm.plan_for(model, (x,)) is None


def test_a_step_leaves_no_hook_on_the_modules_and_still_marks_their_boundaries(tmp_path: Path):
    torch.manual_seed(0)
    model, x = _model(), torch.randn(512, 64)
    global_hooks = (
        len(torch_module._global_forward_pre_hooks),
        len(torch_module._global_forward_hooks),
    )
    seen: list[int] = []  # hooks on the model's modules, in each step
    installed: list[bool] = []  # global module hooks in force, in each step
    with vtensor.MemoryManager("1GiB", storage_dir=tmp_path) as mm:
        for _ in range(3):
            with mm.step(model, inputs=(x,)):
                seen.append(
                    sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
                )
                in_force = (
                    len(torch_module._global_forward_pre_hooks),
                    len(torch_module._global_forward_hooks),
                )
                installed.append(in_force != global_hooks)
                model(x).sum().backward()
        assert mm.trace is not None
        names = {s.name for s in mm.trace.steps}
        lean = [r.lean for r in mm.reports]
    # No step hooks a module of the model. The profiled iteration and the full replay mark the
    # boundaries with global module hooks; the lean replay after them, of a plan that moves
    # nothing, installs none (NOTE [hookless replay] in replay/lean.py).
    assert seen == [0, 0, 0] and installed == [True, True, False] and lean[2]
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == 0
    assert {f"forward:{n}" for n in ("model", "0", "1", "2", "3")} <= names
    assert {f"backward:{n}" for n in ("0", "1", "2", "3")} <= names
    assert (
        len(torch_module._global_forward_pre_hooks),
        len(torch_module._global_forward_hooks),
    ) == global_hooks


def test_a_module_outside_the_model_marks_no_boundary(tmp_path: Path):
    # The boundaries come from hooks on every module of the process while the step lasts.
    torch.manual_seed(0)
    model, x, other = _model(), torch.randn(512, 64), nn.Linear(64, 64)
    with vtensor.MemoryManager("1GiB", storage_dir=tmp_path) as mm:
        with mm.step(model, inputs=(x,)):
            (model(x) + other(x)).sum().backward()
        assert mm.trace is not None
        names = [s.name for s in mm.trace.steps]
    assert sum(n.startswith("forward:") for n in names) == 5  # the model and its four modules
