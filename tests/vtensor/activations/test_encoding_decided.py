"""``encode_masks="auto"``: the plan decides whether clamps save bits (NOTE [one decision] in
``vtensor/activations/plan/decision.py``): where it moves bytes, the next iteration is profiled
with them encoded."""

from pathlib import Path

import pytest
import torch
from clamp_models import bits_of, clamp_model, train_clamps
from recompute_models import Block, model_with

import vtensor
from vtensor.activations.plan.decision import PlanBook
from vtensor.activations.plan.iteration_plan import IterationPlan


def _chosen(monkeypatch: pytest.MonkeyPatch) -> list[IterationPlan]:
    """What each iteration runs with, in order (its encoding among it)."""
    chosen: list[IterationPlan] = []
    for_iteration = PlanBook.for_iteration

    def seen(book: PlanBook, *args: object, **kwargs: object) -> IterationPlan:
        plan = for_iteration(book, *args, **kwargs)  # type: ignore[arg-type]
        chosen.append(plan)
        return plan

    monkeypatch.setattr(PlanBook, "for_iteration", seen)
    return chosen


def _binding_budget(tmp_path: Path) -> int:
    """Under the bytes it saves even encoded; not so far under that swapping alone has no plan.

    At 0.75 of them the plan without encoding was infeasible in some processes.
    """
    with vtensor.MemoryManager(1 << 30, storage_dir=tmp_path, encode_masks=True) as mm:
        train_clamps(clamp_model(), mm, 3)
        assert mm.trace is not None and mm.trace.encoded
        saved = sum(t.nbytes for t in mm.trace.tensors) + mm.trace.unmanaged_saved_bytes
        return mm.trace.baseline_bytes + int(saved * 0.9)


def test_where_the_budget_never_binds_nothing_is_encoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chosen = _chosen(monkeypatch)
    model = clamp_model()
    with vtensor.MemoryManager(1 << 30, storage_dir=tmp_path, encode_masks="auto") as mm:
        train_clamps(model, mm, 3)
        sources = [r.plan_source for r in mm.reports]
        assert mm.trace is not None and not mm.trace.encoded
        moved = sum(r.bytes_out for r in mm.reports)
    assert sources == ["profiled", "planned", "planned"] and moved == 0  # profiled once
    assert not any(c.encode for c in chosen)  # its plan moves nothing: no iteration encodes


@pytest.mark.parametrize("recompute", [False, True], ids=["swap", "hybrid"])
def test_where_it_binds_the_next_iteration_is_profiled_encoded_and_its_plan_validated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recompute: bool
) -> None:
    # NOTE [one decision]: the profile runs unencoded; its plan moves bytes and the model has
    # clamps, so the next iteration is profiled encoded (the reprofile, which also recomputes
    # what the solver chose), and the encoded plan is the one the full replay validates.
    budget = _binding_budget(tmp_path)
    chosen = _chosen(monkeypatch)
    model = clamp_model()
    steps = 6
    with vtensor.MemoryManager(
        budget, storage_dir=tmp_path, recompute=recompute, encode_masks="auto"
    ) as mm:
        train_clamps(model, mm, steps)
        sources = [r.plan_source for r in mm.reports]
        assert mm.trace is not None and mm.trace.encoded  # the reprofile's
    unmanaged = clamp_model()
    train_clamps(unmanaged, None, steps)
    assert sources[:3] == ["profiled", "profiled", "planned"], sources
    assert [c.encode for c in chosen[:3]] == [False, True, True]
    validating = chosen[2].executor
    assert validating is not None and validating.plan.encoded
    # Decided by the third iteration: the plan replays from then on.
    assert all(s == "planned" for s in sources[3:]), sources
    for a, b in zip(model.parameters(), unmanaged.parameters(), strict=True):
        assert torch.equal(bits_of(a), bits_of(b))


def test_a_model_without_clamps_is_profiled_once(tmp_path: Path) -> None:
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(0))
    model = model_with(Block)
    with vtensor.MemoryManager("1TiB", storage_dir=tmp_path) as probe:
        with probe.step(model):
            model(x).sum().backward()
        budget = int(probe.report().peak_device_bytes * 0.6)
    with vtensor.MemoryManager(budget, storage_dir=tmp_path, encode_masks="auto") as mm:
        for _ in range(3):
            with mm.step(model):
                model(x).sum().backward()
        assert [r.plan_source for r in mm.reports] == ["profiled", "planned", "planned"]
        assert any(r.bytes_out for r in mm.reports)  # the budget binds


def test_an_unknown_setting_is_refused_with_the_choices() -> None:
    with pytest.raises(vtensor.VTensorError, match="True, False or 'auto'"):
        vtensor.MemoryManager(1 << 30, encode_masks="yes")
