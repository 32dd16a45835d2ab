"""A decision between candidate plans outlives its manager (NOTE [undecided plans])."""

import json
import logging
from pathlib import Path

import pytest
from recompute_models import Block, batch, managed_steps, model_with, peak_bytes

import vtensor
from vtensor.activations.iteration_plan import Trials
from vtensor.activations.race import MAX_ROUNDS, PlanRace
from vtensor.activations.race import ROUNDS as RACE_ROUNDS
from vtensor.activations.undecided import Undecided
from vtensor.planner.plan import Plan, TensorMove
from vtensor.planner.trace import Trace


def _manager(budget: int, tmp_path: Path) -> vtensor.MemoryManager:
    return vtensor.MemoryManager(
        budget, storage_dir=tmp_path, recompute=True, plan_cache_dir=tmp_path / "plans"
    )


def _files(tmp_path: Path) -> tuple[int, int]:
    """(plans, decisions under way) in the plan cache (provisional plans aside)."""
    names = [p.name for p in (tmp_path / "plans").glob("*.json")]
    names = [n for n in names if not n.endswith(".provisional.json")]
    undecided = sum(n.endswith(".undecided.json") for n in names)
    return len(names) - undecided, undecided


@pytest.fixture
def budget(tmp_path: Path) -> int:
    return int(peak_bytes(Block, tmp_path) * 0.5)


def test_a_race_under_way_when_its_manager_closes_goes_on_in_the_next(
    tmp_path: Path, budget: int
) -> None:
    model = model_with(Block)
    # The profile, a trial per candidate recomputation, then one replay of the race.
    with _manager(budget, tmp_path) as first:
        while not first.reports or first.report().plan_source != "raced":
            assert len(first.reports) < 6
            managed_steps(first, model, 1)
        sources = [r.plan_source for r in first.reports]
    candidates = sources.count("profiled")  # the trials, and the swap-only plan
    assert candidates >= 2 and sources == ["profiled"] * candidates + ["raced"]
    assert _files(tmp_path) == (0, 1)
    with _manager(budget, tmp_path) as second:
        # Each candidate: its replays, close ones up to MAX_ROUNDS, and one made again.
        managed_steps(second, model, candidates * (MAX_ROUNDS + 1) + 1)
        later = [r.plan_source for r in second.reports]
        plan = second.plan_for(model, batch(0))
    assert later[0] == "raced"  # the race goes on: no profile again
    raced = 1 + later.count("raced")  # with the first manager's replay
    assert candidates * RACE_ROUNDS <= raced <= candidates * (MAX_ROUNDS + 1), (sources, later)
    assert later[-1] == "planned" and plan is not None
    assert _files(tmp_path) == (1, 0)  # decided: the plan is cached, the progress gone
    with _manager(budget, tmp_path) as third:
        managed_steps(third, model, 1)
        assert third.report().plan_source == "cached"
        assert third.report().recomputed == plan.recompute


def test_trials_under_way_go_on_with_the_next_candidate(tmp_path: Path, budget: int) -> None:
    model = model_with(Block)
    with _manager(budget, tmp_path) as first:
        managed_steps(first, model, 2)  # the profile and the first trial
        tried = (first.reports[1].recomputed, first.reports[1].selective)
    with _manager(budget, tmp_path) as second:
        managed_steps(second, model, 1)
        report = second.report()
    assert tried[0] and report.plan_source == "profiled"
    # The second candidate's trial: candidates differ in their units or in those selective.
    assert report.recomputed and (report.recomputed, report.selective) != tried


def test_unreadable_progress_is_ignored_and_the_model_profiled_again(
    tmp_path: Path, budget: int, caplog: pytest.LogCaptureFixture
) -> None:
    model = model_with(Block)
    with _manager(budget, tmp_path) as first:
        managed_steps(first, model, 5)  # the profile, the trials, and the race begun
    (progress,) = (tmp_path / "plans").glob("*.undecided.json")
    entry = json.loads(progress.read_text())
    entry["progress"] = entry["progress"].replace('"turn": ', '"turn": 1')  # sha256 no longer fits
    progress.write_text(json.dumps(entry))
    with caplog.at_level(logging.WARNING), _manager(budget, tmp_path) as second:
        managed_steps(second, model, 1)
        report = second.report()
    assert report.plan_source == "profiled" and report.recomputed == ()
    assert "checksum" in caplog.text and "profiling again" in caplog.text


def _plan(budget: int) -> Plan:
    """A plan that moves its one tensor (one that moves nothing would end a race it replays in)."""
    move = TensorMove(vid=0, evict_bytes=4096, evict_step=0, prefetch_step=1)
    return Plan(budget, 1 << 20, (move,), ("forward:0", "backward:0"), (4096,), budget, 0.0, "t")


def test_progress_round_trips_with_its_plans_shared_as_they_were() -> None:
    hybrid, swap_only, pending = _plan(100), _plan(200), (("a", "b"), ("b",))
    trace = Trace((), (), 0, 0, 1000, None, "cpu")
    race = PlanRace([hybrid, swap_only], unit_s={"a": (0.002, 0.001)})
    race.record(0.5)
    race.record(0.25, guard_bytes=0)
    race.record(0.2, lean=True)
    growth = {"a": (300, 200), "b": (100, 0)}
    kept = ((("a", "b"), ()),)  # never dropped as recomputing more (NOTE [dominated candidates])
    unit_s = {"a": (0.002, 0.001), "b": (0.003, 0.0015)}
    trials = Trials([pending], [hybrid], swap_only, growth, True, ("a",), kept, cached=("b",))
    trials.unit_s = unit_s
    undecided = Undecided(trials, race, [(hybrid, (trace, 7, 9))])
    back = Undecided.from_dict(json.loads(json.dumps(undecided.to_dict())))
    assert back.trials is not None and back.race is not None
    assert back.trials.pending == [pending] and back.trials.growth == growth
    assert back.trials.kept == kept
    assert back.trials.unit_s == unit_s
    trial = back.trials.next_trial("s", None)
    assert trial.regrowth == {"a": 300, "b": 0} and trial.encode  # b selective; as profiled
    # a whole behind one node, b selectively behind one, its convolutions kept
    assert trial.one_node == ("a", "b") and back.trials.cached == ("b",)
    assert back.trials.plans[0] is back.race.plans[0] is back.candidates[0][0]
    assert back.trials.swap_only is back.race.plans[1]
    assert back.race.plans == [hybrid, swap_only] and back.race.unit_s == race.unit_s
    assert (back.race.times, back.race.turn, back.race.clean, back.race.leans) == (
        race.times,
        race.turn,
        race.clean,
        [[False, True], [False]],
    )
    # Progress written before lean times were told apart: its times count as full ones.
    older = undecided.to_dict()
    del older["race"]["leans"]
    assert Undecided.from_dict(older).race.leans == [[False, False], [False]]  # type: ignore[union-attr]
    older["race"]["leans"] = [[True], [False]]
    with pytest.raises(ValueError, match="lean flags"):
        Undecided.from_dict(older)
    assert back.candidates[0][1][1:] == (7, 9) and back.candidates[0][1][0] == trace


def test_progress_that_is_not_a_decision_under_way_is_refused() -> None:
    trace = Trace((), (), 0, 0, 1000, None, "cpu")
    done = Undecided(Trials([], [_plan(100)], _plan(200)), None, [(_plan(100), (trace, 0, 0))])
    with pytest.raises(ValueError, match="no candidate left"):
        Undecided.from_dict(json.loads(json.dumps(done.to_dict())))
    with pytest.raises(ValueError, match="neither"):
        Undecided.from_dict(Undecided().to_dict())
