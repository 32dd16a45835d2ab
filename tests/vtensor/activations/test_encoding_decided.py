"""``encode_masks="auto"``: the plan decides whether clamps save bits (NOTE [encoding decided])."""

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from clamp_models import bits_of, clamp_model, clamp_steps, train_clamps
from recompute_models import Block, model_with

import vtensor
import vtensor.activations.planning
from vtensor.activations.race import PlanRace
from vtensor.planner.plan import Plan


class _Seen(PlanRace):
    races: ClassVar[list[PlanRace]] = []

    def __init__(self, plans: list[Plan], **race: Any) -> None:
        super().__init__(plans, **race)
        _Seen.races.append(self)


def _binding_budget(tmp_path: Path) -> int:
    """Under the bytes it saves even encoded; not so far under that swapping alone has no plan.

    At 0.75 of them the plan without encoding was infeasible in some processes: nothing raced.
    """
    with vtensor.MemoryManager(1 << 30, storage_dir=tmp_path, encode_masks=True) as mm:
        train_clamps(clamp_model(), mm, 3)
        assert mm.trace is not None and mm.trace.encoded
        saved = sum(t.nbytes for t in mm.trace.tensors) + mm.trace.unmanaged_saved_bytes
        return mm.trace.baseline_bytes + int(saved * 0.9)


def test_where_the_budget_never_binds_nothing_is_encoded(tmp_path: Path) -> None:
    model = clamp_model()
    with vtensor.MemoryManager(1 << 30, storage_dir=tmp_path, encode_masks="auto") as mm:
        train_clamps(model, mm, 3)
        sources = [r.plan_source for r in mm.reports]
        assert mm.trace is not None and not mm.trace.encoded
        moved = sum(r.bytes_out for r in mm.reports)
    assert sources == ["profiled", "planned", "planned"] and moved == 0  # profiled once


@pytest.mark.parametrize("recompute", [False, True], ids=["swap", "hybrid"])
def test_where_it_binds_both_plans_race_and_training_stays_bit_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recompute: bool
) -> None:
    monkeypatch.setattr(vtensor.activations.planning, "PlanRace", _Seen)
    monkeypatch.setattr(_Seen, "races", [])
    budget = _binding_budget(tmp_path)
    model = clamp_model()
    with vtensor.MemoryManager(
        budget, storage_dir=tmp_path, recompute=recompute, encode_masks="auto"
    ) as mm:
        # How many steps the decision takes depends on how many trials fit near this budget
        # and how close the race is (NOTE [close race]): at least 16, until one is planned.
        steps = 0
        for _ in clamp_steps(model, mm):
            steps += 1
            if (steps >= 16 and mm.reports[-1].plan_source == "planned") or steps == 64:
                break
        sources = [r.plan_source for r in mm.reports]
    unmanaged = clamp_model()
    train_clamps(unmanaged, None, steps)
    # Profiled without encoding (its plan moves bytes), then with it; a trial per candidate.
    assert sources[:2] == ["profiled", "profiled"] and sources[-1] == "planned", sources
    (race,) = _Seen.races
    encoded = [p.encoded for p in race.plans]
    # Whether trials of recomputation fit near this budget depends on the process; those that
    # ran encoded as their profile did (each in ``encoded[1:]``; ``Trials.next_trial`` tested
    # apart).
    assert encoded[0] is False and all(encoded[1:]) and len(encoded) >= 2, encoded
    assert recompute or not any(p.recompute for p in race.plans)
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
