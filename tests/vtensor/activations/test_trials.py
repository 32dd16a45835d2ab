"""Trials of recomputation: judged at the budget the plan is made at, and keeping it."""

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from recompute_models import Block, managed_steps, only
from torch import nn

import vtensor
import vtensor.activations.planning
from vtensor.activations.iteration_plan import Trials
from vtensor.planner.dominance import unit_costs
from vtensor.planner.plan import Plan, TensorMove
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
        managed_steps(probe, _model(), 1)
        budget = int(probe.report().peak_device_bytes * 0.7)
    model = _model()
    with (
        caplog.at_level(logging.WARNING),
        vtensor.MemoryManager(
            budget, storage_dir=tmp_path, recompute=True, chunk_bytes=CHUNK
        ) as mm,
    ):
        managed_steps(mm, model, 2)  # the profile, then the trial
        trial = mm.report()
    assert trial.plan_source == "profiled" and trial.recomputed == (DEEP, SMALL), trial
    assert trial.peak_device_bytes <= budget + CHUNK, (trial.peak_device_bytes, budget)
    assert "broke the budget" not in caplog.text


def _two_units(reserve_kb: int) -> tuple[Trace, int]:
    """Units a then b, each saving a 1 KB input and 100 KB inside, used in its backward."""
    from vtensor.planner.trace import Phase, TraceStep, TraceTensor, TraceUnit

    kb = 1024
    names = ["forward:a", "forward:b", "backward:b", "backward:a"]
    steps = tuple(
        TraceStep(i, n, Phase(n.split(":")[0]), 0.01, 0, 0, 0) for i, n in enumerate(names)
    )
    tensors = []
    units = []
    for i, name in enumerate("ab"):
        back = 3 - i
        tensors += [
            TraceTensor(2 * i, kb, ("float32",), i, i + 1, (back,)),
            TraceTensor(2 * i + 1, 100 * kb, ("float32",), i, i + 1, (back,)),
        ]
        units.append(TraceUnit(name, i, i, 0.001, (2 * i + 1,), (2 * i,), True))
    trace = Trace(steps, tuple(tensors), 0, 0, 0, 64 * kb, "cpu", units=tuple(units))
    return trace, reserve_kb * kb


def test_recomputation_is_judged_at_the_budget_the_plan_is_made_at() -> None:
    # The guard's reserve leaves less than the swap-only floor under its watermark, so the
    # plan is made at the whole budget (NOTE [plan within the guard]); recomputing a unit fits
    # there, and is tried. Judged under the watermark, no candidate fitted: the char GPT at
    # 50 and 40 % of its peak never tried one.
    from vtensor.activations.iteration_plan import IterationPlan
    from vtensor.activations.planning import PlanBook
    from vtensor.activations.report import PlanSource
    from vtensor.planner.lgm import build_lgm, min_budget

    trace, reserve = _two_units(reserve_kb=80)
    budget = 160 * 1024
    floor = min_budget(build_lgm(trace, trace.chunk_bytes))[0]
    assert budget - reserve < floor <= budget
    book = PlanBook(budget, 64 * 1024, None, recompute=True)
    profiled = IterationPlan("sig", PlanSource.PROFILED, None, True, None)
    plan = book._choose(profiled, trace, reserve, floor)
    assert plan is not None and plan.budget_bytes == budget  # the whole budget
    assert book._trial["sig"].pending  # a recomputation to try


def test_a_trial_makes_room_for_at_least_what_each_recomputation_then_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE [regrowth bound]: the ResNet's blocks and stem, recomputed whole or selectively,
    # held up to 3 times their inner tensors, and a selective stem 1.06 MB against none.
    from benchmarks.zoo import ZOO
    from vtensor.activations.iteration import Iteration

    held: list[tuple[str, int, int]] = []  # (unit's step, room made, bytes it then held)
    began, ended = Iteration.recompute_began, Iteration.recompute_ended

    def beginning(self: Iteration, regrowth_bytes: int) -> None:
        if self.recomputing == 1 and self.record_trace:
            self._probe = (regrowth_bytes, self.live_bytes())  # type: ignore[attr-defined]
        began(self, regrowth_bytes)

    def ending(self: Iteration) -> None:
        probe = getattr(self, "_probe", None)
        if self.recomputing == 1 and probe is not None:
            held.append((self._step_name(), probe[0], self.live_bytes() - probe[1]))
            self._probe = None  # type: ignore[attr-defined]
        ended(self)

    monkeypatch.setattr(Iteration, "recompute_began", beginning)
    monkeypatch.setattr(Iteration, "recompute_ended", ending)
    entry = ZOO["resnet"]
    torch.manual_seed(0)
    model = entry.build()

    def step(mm: vtensor.MemoryManager) -> None:
        model.zero_grad(set_to_none=True)
        with mm.step(model):  # the batch is made inside, as in the equivalence tests
            inputs, targets = entry.make_batch(entry.batch_size, seed=0)
            entry.loss(model(inputs), targets).backward()

    with vtensor.MemoryManager("1TiB", storage_dir=tmp_path / "free") as probe:
        step(probe)
        budget = int(probe.report().peak_device_bytes * 0.75)
    with vtensor.MemoryManager(
        budget, storage_dir=tmp_path, recompute=True, chunk_bytes=CHUNK
    ) as mm:
        for _ in range(5):  # the profile, then the trials
            step(mm)
    assert held, "no trial recomputed anything"
    assert all(room >= nbytes for _, room, nbytes in held), held


def _hybrid_base(moves: bool) -> Plan:
    move = (TensorMove(vid=0, evict_bytes=1 << 20, evict_step=1, prefetch_step=2),)
    return Plan(1 << 30, None, move if moves else (), ("a", "b", "c"), (1 << 20,), 0, 0.0, "test")


def test_a_trial_that_moves_nothing_drops_the_pending_candidates_that_recompute_more() -> None:
    # NOTE [dominated candidates]: recomputing all of what a plan that moves nothing recomputes,
    # and more, moves nothing at best and computes more: no faster, so no trial and no race.
    pending = [
        (("f.2", "f.3"), ()),
        (("f.2", "f.3", "f.4"), ("f.4",)),  # whole where the first is, more beside: dropped
        (("f",), ()),  # an ancestor of both, whole: dropped
        (("f.2", "f.3", "f.5"), ("f.2",)),  # f.2 selectively recomputes less: kept
        (("f.2",), ()),  # less: kept
        (("g", "f.3.body"), ()),  # only inside f.3: kept
    ]
    trials = Trials(list(pending), [], None)
    assert trials.profiled(_hybrid_base(moves=False), 0.1) is not None
    assert trials.pending == [pending[3], pending[4], pending[5]]
    # A trial whose plan moves bytes: a candidate recomputing more may move less, and is tried.
    trials = Trials(list(pending), [], None)
    trials.profiled(_hybrid_base(moves=True), 0.1)
    assert trials.pending == pending[1:]
    # What checkpointing every block does stays (``kept``), whatever it recomputes.
    trials = Trials(list(pending), [], None, kept=(pending[2],))
    trials.profiled(_hybrid_base(moves=False), 0.1)
    assert trials.pending == [pending[2], pending[3], pending[4], pending[5]]
    # Selective in the plan: covered by the same module selectively or whole, or an ancestor.
    selective = [(("f.2",), ("f.2",)), (("f.2",), ("f.2",)), (("f.2",), ()), (("f",), ("f",))]
    trials = Trials(list(selective), [], None)
    trials.profiled(_hybrid_base(moves=False), 0.1)
    assert trials.pending == []


def test_a_trial_that_moves_nothing_drops_the_pending_candidates_priced_higher() -> None:
    # NOTE [priced higher]: both would move nothing at best; the rest costs more in
    # recomputation, as the profile priced each unit.
    unit_s = {"f.0": (0.002, 0.001), "f.2": (0.0025, 0.0015), "f.3": (0.002, 0.001)}
    unit_s |= {"f.4": (0.006, 0.003), "f.5": (0.001, 0.0005)}
    cover = (("f.2", "f.3"), ())  # 4.5 ms
    pending = [
        cover,
        (("f.0", "f.2"), ("f.0",)),  # 3.5 ms: priced lower, tried
        (("f.0", "f.4"), ()),  # 8 ms: dropped
        (("f.2", "f.5"), ("f.2", "f.5")),  # 2 ms: tried
        (("f.2", "g"), ()),  # g is not priced: tried
        (("f.0", "f.2", "f.4", "f.5"), ()),  # 11.5 ms, what checkpointing every block does
    ]

    def left(moves: bool = False, priced: bool = True) -> list[tuple[tuple[str, ...], ...]]:
        costs = unit_s if priced else {}
        trials = Trials(list(pending), [], None, kept=(pending[-1],), unit_s=costs)
        trials.profiled(_hybrid_base(moves=moves), 0.1)
        return trials.pending

    assert left() == [pending[1], pending[3], pending[4], pending[5]]
    assert left(priced=False) == pending[1:]  # nothing priced: none is priced higher
    assert left(moves=True) == pending[1:]  # the trial's plan moves bytes


def test_each_safe_unit_is_priced_whole_and_selectively() -> None:
    trace, _ = _two_units(0)
    a = dataclasses.replace(trace.units[0], selective_s=0.0005, overhead_s=0.0002)
    unsafe = dataclasses.replace(trace.units[1], safe=False)
    costs = unit_costs(dataclasses.replace(trace, units=(a, unsafe)))
    assert costs == {"a": (a.forward_s + 0.0002, 0.0005)}
