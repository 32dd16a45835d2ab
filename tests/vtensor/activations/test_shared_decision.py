"""Managers sharing a plan cache decide a key once; the others follow (NOTE [one decider])."""

import dataclasses
import gc
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from recompute_models import Block, batch, model_with, peak_bytes, train_steps
from torch import nn

import vtensor
from vtensor.activations.executor import PlanExecutor
from vtensor.activations.iteration_plan import IterationPlan
from vtensor.activations.race import PlanRace
from vtensor.activations.report import PlanSource
from vtensor.activations.shared_plans import SharedPlans
from vtensor.planner import claims
from vtensor.planner.keys import PlanKey
from vtensor.planner.plan import Plan, TensorMove

STEPS = 40  # enough for the decider's profile, trials and race


def _manager(budget: int, tmp_path: Path) -> vtensor.MemoryManager:
    return vtensor.MemoryManager(
        budget, storage_dir=tmp_path, recompute=True, plan_cache_dir=tmp_path / "plans"
    )


def _steps(
    mm: vtensor.MemoryManager | None, model: nn.Module, grads: list[list[torch.Tensor]]
) -> Iterator[None]:
    """``STEPS`` steps of ``model`` (under ``mm``), one per ``next``, as ``train`` runs them."""
    return train_steps(model, mm, grads, STEPS)


def _files(tmp_path: Path, suffix: str) -> list[Path]:
    return sorted((tmp_path / "plans").glob(f"*{suffix}"))


@pytest.fixture
def budget(tmp_path: Path) -> int:
    return int(peak_bytes(Block, tmp_path) * 0.5)


def test_a_second_manager_follows_the_first_and_never_profiles(tmp_path: Path, budget: int) -> None:
    # Two managers on one key, stepping in turn as two clients started together do.
    decider_model, follower_model = model_with(Block), model_with(Block)
    grads: list[list[torch.Tensor]] = []
    with _manager(budget, tmp_path) as decider, _manager(budget, tmp_path) as follower:
        turns = zip(
            _steps(decider, decider_model, []),
            _steps(follower, follower_model, grads),
            strict=False,
        )
        published = []
        for _ in turns:
            published.append(bool(_files(tmp_path, ".provisional.json")))
        first = [r.plan_source for r in decider.reports]
        second = [r.plan_source for r in follower.reports]
        plan = decider.plan_for(decider_model, batch(0))
    assert first[0] == "profiled" and "raced" in first and first[-1] == "planned"
    # The follower neither profiled nor raced: the decider's plans, then the cached one.
    assert second[0] == "shared" and set(second) == {"shared", "cached", "planned"}, second
    decided = second.index("cached")
    assert set(second[:decided]) == {"shared"} and set(second[decided + 1 :]) == {"planned"}
    assert any(published), "the decider published no provisional plan"
    # Once published, the follower replayed it (a plan's prediction), not the reactive policy.
    shared = [r for r in follower.reports if r.plan_source == "shared"]
    assert any(r.predicted_peak_bytes is not None for r in shared)
    assert all(r.peak_device_bytes <= budget for r in follower.reports)
    assert plan is not None and follower.reports[-1].recomputed == plan.recompute
    # Decided: the plan is cached, and no claim or provisional plan is left.
    assert len(_files(tmp_path, ".json")) == 1
    assert not _files(tmp_path, ".claim") and not _files(tmp_path, ".provisional.json")
    # Bit-identical to training without vtensor.
    want: list[list[torch.Tensor]] = []
    reference = model_with(Block)
    for _ in _steps(None, reference, want):
        pass
    for step, (a, b) in enumerate(zip(want, grads, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"step {step}"


def _first_source_with_claim(
    tmp_path: Path, budget: int, owner: dict[str, object], age_s: float
) -> str:
    """The first plan source of a manager whose key another claims as ``owner``."""
    with _manager(budget, tmp_path) as probe:  # one profiled step: its claim names the key
        for _ in zip(range(1), _steps(probe, model_with(Block), []), strict=False):
            pass
        (claim,) = _files(tmp_path, ".claim")
    for path in (tmp_path / "plans").iterdir():
        path.unlink()  # nothing cached, nothing claimed
    claim.write_text(json.dumps(owner))
    then = time.time() - age_s
    os.utime(claim, (then, then))
    with _manager(budget, tmp_path) as mm:
        for _ in zip(range(1), _steps(mm, model_with(Block), []), strict=False):
            pass
        return mm.report().plan_source


def _dead_pid() -> int:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    return done.pid


def test_a_live_fresh_claim_is_followed(tmp_path: Path, budget: int) -> None:
    me = {"host": socket.gethostname(), "pid": os.getpid(), "id": "another manager"}
    assert _first_source_with_claim(tmp_path, budget, me, 0.0) == "shared"


@pytest.mark.parametrize("why", ["dead process", "not refreshed", "another host, silent"])
def test_a_stale_claim_is_taken_over(tmp_path: Path, budget: int, why: str) -> None:
    owner: dict[str, object] = {"host": socket.gethostname(), "pid": os.getpid(), "id": "x"}
    age = 0.0
    if why == "dead process":
        owner["pid"] = _dead_pid()
    elif why == "not refreshed":
        age = claims.STALE_S + 60
    else:
        owner, age = {"host": "elsewhere", "pid": 1, "id": "x"}, claims.STALE_S + 60
    assert _first_source_with_claim(tmp_path, budget, owner, age) == "profiled"


def test_a_decider_closed_undecided_hands_the_decision_to_a_follower(
    tmp_path: Path, budget: int
) -> None:
    decider_model, follower_model = model_with(Block), model_with(Block)
    with _manager(budget, tmp_path) as follower:
        steps = _steps(follower, follower_model, [])
        with _manager(budget, tmp_path) as decider:
            for _ in zip(range(6), _steps(decider, decider_model, []), steps, strict=False):
                pass
            assert "raced" in [r.plan_source for r in decider.reports]
        # Closed: its progress is parked, its claim gone, its provisional plan still there.
        assert _files(tmp_path, ".undecided.json") and not _files(tmp_path, ".claim")
        assert _files(tmp_path, ".provisional.json")
        next(steps)
        assert follower.report().plan_source == "raced"  # it took the race up
        assert _files(tmp_path, ".claim")  # and claimed the key
    assert not _files(tmp_path, ".claim")


def test_a_manager_dropped_without_close_lets_go_of_its_claim(tmp_path: Path, budget: int) -> None:
    mm = _manager(budget, tmp_path)
    for _ in zip(range(1), _steps(mm, model_with(Block), []), strict=False):
        pass
    assert _files(tmp_path, ".claim")  # deciding: its profile, trials to come
    del mm  # collected, it closes (parking its decision) and lets go of its claim
    gc.collect()
    assert not _files(tmp_path, ".claim")  # the next manager decides, not follows
    with _manager(budget, tmp_path) as again:
        for _ in zip(range(1), _steps(again, model_with(Block), []), strict=False):
            pass
        assert again.report().plan_source == "profiled"


def test_an_infeasible_budget_lets_go_of_the_claim(tmp_path: Path, budget: int) -> None:
    with _manager(budget // 50, tmp_path) as mm:
        with pytest.raises(vtensor.InfeasibleBudgetError):
            for _ in _steps(mm, model_with(Block), []):
                pass
        assert not _files(tmp_path, ".claim")  # the next manager finds out for itself


def _key(budget: int = 1000) -> PlanKey:
    return PlanKey(
        architecture="arch",
        input_signature="sig",
        dtype="float32",
        budget_bytes=budget,
        chunk_bytes=1 << 20,
        device_kind="cpu",
        planner_version="v",
        torch_version="t",
        params="",
    )


def _executor(plan: Plan) -> PlanExecutor:
    return SimpleNamespace(plan=plan)  # type: ignore[return-value]  # what following reads


def test_an_unreadable_provisional_plan_is_ignored_and_a_broken_one_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    decider, follower, key = SharedPlans(tmp_path), SharedPlans(tmp_path), _key()
    assert decider.decides(key) and not follower.decides(key)
    plan = Plan(1000, 1 << 20, (), ("forward:0",), (4096,), 1000, 0.0, "test")
    decider.publish(key, None, [(plan, None)], {})  # type: ignore[list-item]
    chosen = follower.follow("s", key, _executor)
    assert chosen.executor.plan == plan and chosen.source is PlanSource.SHARED and chosen.following
    assert not chosen.lean
    # A full replay here that needed the guard: full again; one that needed none: lean.
    follower.replayed(chosen, guard_bytes=4096)
    assert not follower.follow("s", key, lambda p: p).lean  # type: ignore[arg-type,return-value]
    follower.replayed(chosen, guard_bytes=0)
    chosen = follower.follow("s", key, _executor)
    assert chosen.lean
    # Its replay broke the budget here: excused, and the follower goes reactive until the next.
    assert follower.excuse(chosen) and chosen.abandoned
    assert follower.follow("s", key, lambda p: p).executor is None  # type: ignore[arg-type,return-value]
    assert not follower.excuse(IterationPlan("s", PlanSource.SHARED, None, False, key))
    path = decider.cache.provisional_path(key)
    path.write_text(path.read_text().replace('"plan_sha256": "', '"plan_sha256": "0'))
    os.utime(path, ns=(time.time_ns() + 10**9,) * 2)  # a new publication, unreadable
    with caplog.at_level(logging.WARNING):
        assert follower.follow("s", key, lambda p: p).executor is None  # type: ignore[arg-type,return-value]
    assert "checksum" in caplog.text
    decider.settle(key)
    assert not path.exists() and follower.decides(key)


_PROCESS = """
import json, sys, time
from pathlib import Path
import torch
from torch import nn
import vtensor

cache, go, budget = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(512, 256)
if budget == "peak":  # measured in a process of this kind, unmanaged (a budget never binding)
    with vtensor.MemoryManager("1TiB") as mm:
        for _ in range(2):
            with mm.step(model, opt, inputs=(x,)):
                model(x).square().mean().backward()
            opt.step()
    print(max(r.peak_device_bytes for r in mm.reports))
    sys.exit()
while not go.exists():
    time.sleep(0.001)
with vtensor.MemoryManager(int(budget), recompute=True, plan_cache_dir=cache) as mm:
    for _ in range(12):
        opt.zero_grad(set_to_none=True)
        with mm.step(model, opt, inputs=(x,)):
            model(x).square().mean().backward()
        opt.step()
    print(json.dumps([r.plan_source for r in mm.reports]))
"""


def test_processes_started_together_decide_once(tmp_path: Path) -> None:
    go = tmp_path / "go"
    script = [sys.executable, "-c", _PROCESS, str(tmp_path / "plans"), str(go)]
    peak = subprocess.run([*script, "peak"], capture_output=True, text=True, check=True)
    budget = int(peak.stdout) // 2
    procs = [
        subprocess.Popen(
            [*script, str(budget)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    time.sleep(2.0)  # both imported torch and wait
    go.touch()
    sources = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    profiled = [s for s in sources if "profiled" in s]
    assert len(profiled) == 1, sources
    (other,) = [s for s in sources if "profiled" not in s]
    # It followed (or found the plan decided), and never profiled; had the decider closed
    # undecided first, it would have taken the race up (NOTE [undecided plans]).
    assert other[0] in ("shared", "cached"), sources


def test_before_the_race_the_decider_publishes_the_plan_that_moves_nothing_priced_least(
    tmp_path: Path,
) -> None:
    # NOTE [priced higher]: the trials' traces predict their steps from hook-laden timings; a
    # plan that moves nothing, priced from the profile's units, is the one to follow meanwhile.
    decider, follower, key = SharedPlans(tmp_path), SharedPlans(tmp_path), _key()
    assert decider.decides(key)
    base = Plan(1000, 1 << 20, (), ("forward:0", "backward:0"), (4096,), 1000, 0.0, "test")
    move = TensorMove(vid=0, evict_bytes=4096, evict_step=0, prefetch_step=1)
    swap_only = dataclasses.replace(base, moves=(move,), predicted_step_s=0.1)
    a = dataclasses.replace(base, recompute=("a",), predicted_step_s=0.2)
    b = dataclasses.replace(base, recompute=("b",), predicted_step_s=0.3)
    unit_s = {"a": (0.005, 0.004), "b": (0.004, 0.003)}
    plans = [(swap_only, None), (a, None), (b, None)]
    decider.publish(key, None, plans, unit_s)  # type: ignore[arg-type]
    assert follower.follow("s", key, _executor).executor.plan == b
    decider.publish(key, None, plans, {})  # type: ignore[arg-type]  # nothing priced
    assert follower.follow("s", key, _executor).executor.plan == swap_only
    # So does a race's leader before every candidate has run.
    race = PlanRace([swap_only, a, b], unit_s=unit_s)
    assert race.leader() is b
    race.unit_s = {}
    assert race.leader() is swap_only
