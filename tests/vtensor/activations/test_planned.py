"""Planned execution: replay, divergence and fallback, plan cache across processes."""

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import vtensor


class Branchy(nn.Module):
    """An MLP whose depth depends on a flag: data-dependent control flow."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(8))
        self.extra = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
        self.take_extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:4]:
            x = layer(x)
        if self.take_extra:
            x = self.extra(x)
        for layer in self.layers[4:]:
            x = layer(x)
        return x


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros(0) for p in model.parameters()]


def _run(model: nn.Module, x: torch.Tensor, mm: vtensor.MemoryManager | None, **kw: object):
    model.zero_grad()
    if mm is None:
        model(x).square().mean().backward()
    else:
        with mm.step(model, **kw):
            model(x).square().mean().backward()
    return _grads(model)


def _budget(model: nn.Module, x: torch.Tensor, fraction: float) -> int:
    with vtensor.MemoryManager("1GiB") as mm:
        _run(model, x, mm)
        return int(mm.report().peak_device_bytes * fraction)


def test_planned_replay_matches_prediction_and_moves_bytes(tmp_path):
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(4096, 64)
    budget = _budget(model, x, 0.85)
    ref = _run(model, x, None)
    with vtensor.MemoryManager(budget, chunk_bytes=65536, storage_dir=tmp_path) as mm:
        for _ in range(3):
            assert all(map(torch.equal, ref, _run(model, x, mm, inputs=(x,))))
        sources = [r.plan_source for r in mm.reports]
        assert sources == ["profiled", "planned", "planned"]
        planned = mm.reports[-1]
        assert planned.policy == "planned"
        assert planned.bytes_out > 0 and planned.predicted_peak_bytes is not None
        assert planned.peak_device_bytes <= budget + 65536
    assert mm.trace is not None and vtensor.Trace.from_json(mm.trace.to_json()) == mm.trace


def test_divergence_falls_back_within_budget_and_replans(tmp_path):
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(4096, 64)
    budget = _budget(model, x, 0.85)
    with vtensor.MemoryManager(budget, chunk_bytes=65536, storage_dir=tmp_path) as mm:
        _run(model, x, mm)
        _run(model, x, mm)
        model.take_extra = True  # data-dependent control flow: one more layer than the plan
        ref = _run(model, x, None)
        assert all(map(torch.equal, ref, _run(model, x, mm)))
        assert mm.report().plan_source == "fallback"
        assert mm.report().peak_device_bytes <= budget + 65536
        _run(model, x, mm)  # profiles the new shape of the run
        _run(model, x, mm)
        assert [r.plan_source for r in mm.reports[-2:]] == ["profiled", "planned"]


def test_smaller_last_batch_works_with_and_without_its_signature(tmp_path):
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(4096, 64)
    budget = _budget(model, x, 0.85)
    small = x[:1000]
    ref = _run(model, small, None)
    with vtensor.MemoryManager(budget, chunk_bytes=65536, storage_dir=tmp_path) as mm:
        _run(model, x, mm)
        _run(model, x, mm)
        # Without inputs the manager cannot tell the batch changed: the replay notices it.
        assert all(map(torch.equal, ref, _run(model, small, mm)))
        assert mm.report().plan_source == "fallback"
    with vtensor.MemoryManager(budget, chunk_bytes=65536, storage_dir=tmp_path) as mm:
        _run(model, x, mm, inputs=(x,))
        _run(model, x, mm, inputs=(x,))
        # With inputs the smaller batch has a plan of its own.
        assert all(map(torch.equal, ref, _run(model, small, mm, inputs=(small,))))
        assert mm.report().plan_source == "profiled"


FRESH_PROCESS = r"""
import sys, torch, vtensor
sys.path.insert(0, sys.argv[2])
from test_planned import Branchy, _run
torch.manual_seed(0)
model, x = Branchy(), torch.randn(4096, 64)
# The first backward of a process allocates one-time buffers (thread pools, kernel caches) that
# the profiled process had already made: run it once outside the manager.
_run(model, x, None)
with vtensor.MemoryManager(int(sys.argv[3]), chunk_bytes=65536, plan_cache_dir=sys.argv[1]) as mm:
    _run(model, x, mm, inputs=(x,))
    print("SOURCE", mm.report().plan_source, mm.report().cache_load_s)
"""


def test_fresh_process_uses_cached_plan_and_corrupt_cache_replans(tmp_path, caplog):
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(4096, 64)
    budget = _budget(model, x, 0.85)
    cache = tmp_path / "plans"
    with vtensor.MemoryManager(budget, chunk_bytes=65536, plan_cache_dir=cache) as mm:
        _run(model, x, mm, inputs=(x,))
        assert mm.report().plan_source == "profiled"
    here = str(__import__("pathlib").Path(__file__).parent)

    def fresh() -> str:
        proc = subprocess.run(
            [sys.executable, "-c", FRESH_PROCESS, str(cache), here, str(budget)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
        return next(line for line in out.splitlines() if line.startswith("SOURCE")).split()[1]

    assert fresh() == "cached"  # no profiling iteration in the new process
    (entry,) = cache.glob("*.json")
    entry.write_text(entry.read_text()[: len(entry.read_text()) // 2])  # truncate it
    with caplog.at_level(logging.WARNING):
        with vtensor.MemoryManager(budget, chunk_bytes=65536, plan_cache_dir=cache) as mm:
            ref = _run(model, x, None)
            assert all(map(torch.equal, ref, _run(model, x, mm, inputs=(x,))))
            assert mm.report().plan_source == "profiled"
    assert any("plan" in r.getMessage().lower() for r in caplog.records)
    assert fresh() == "cached"  # the corrupt entry was replaced by the new plan


def test_replay_with_slow_writes_keeps_budget_and_resident_prefix(tmp_path, monkeypatch):
    """Replayed evictions are not awaited at every hook: slow writes must still keep the budget.

    Also checks the O(1) ``evictable_bytes`` against its definition (the DEVICE chunks).
    """
    from vtensor.activations.store import chunk_store as store_module
    from vtensor.io import tiers

    write = tiers.StorageTier.writev

    def slow_write(self: tiers.StorageTier, offset: int, views: list[memoryview]) -> None:
        time.sleep(0.002)  # writes slower than the ops they should overlap
        write(self, offset, views)

    evictable_bytes = store_module.ChunkStore.evictable_bytes

    def checked(self: store_module.ChunkStore, record: store_module.VTensor) -> int:
        nbytes = evictable_bytes(self, record)
        if nbytes:
            assert nbytes == sum(c.nbytes for c in record.device_chunks())
        return nbytes

    monkeypatch.setattr(tiers.StorageTier, "writev", slow_write)
    monkeypatch.setattr(store_module.ChunkStore, "evictable_bytes", checked)
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(4096, 64)
    budget = _budget(model, x, 0.6)
    ref = _run(model, x, None)
    with vtensor.MemoryManager(budget, chunk_bytes=65536, storage_dir=tmp_path) as mm:
        for _ in range(3):
            assert all(map(torch.equal, ref, _run(model, x, mm, inputs=(x,))))
        assert [r.policy for r in mm.reports[1:]] == ["planned", "planned"]
        assert all(r.peak_device_bytes <= budget + 65536 for r in mm.reports)
        assert mm.reports[-1].bytes_out > 0


def test_replay_counting_workspaces_waits_for_early_evictions_at_their_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With count_workspaces the plan gives a step's evicted bytes to its workspace, which no
    sample sees: an eviction started a step early must be complete when its step begins
    (NOTE [eviction timing]); without it, slow writes are still running then."""
    from vtensor.activations.replay.executor import PlanExecutor
    from vtensor.io import tiers

    write = tiers.StorageTier.writev

    def slow_write(self: tiers.StorageTier, offset: int, views: list[memoryview]) -> None:
        time.sleep(0.002)
        write(self, offset, views)

    on_step = PlanExecutor.on_step
    running: list[int] = []

    def checked(self: PlanExecutor, index: int, name: str, *room: object) -> None:
        on_step(self, index, name, *room)
        for vid, step in self._started:
            pending = self.records[vid].pending if step == index else None
            running.append(int(pending is not None and pending.outgoing))

    monkeypatch.setattr(tiers.StorageTier, "writev", slow_write)
    monkeypatch.setattr(PlanExecutor, "on_step", checked)
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(4096, 64)
    budget = _budget(model, x, 0.8)  # clear of the floor: the plan must replay in any process
    ref = _run(model, x, None)
    for count in (False, True):
        running.clear()
        with vtensor.MemoryManager(
            budget, chunk_bytes=65536, storage_dir=tmp_path, count_workspaces=count
        ) as mm:
            for _ in range(3):
                assert all(map(torch.equal, ref, _run(model, x, mm, inputs=(x,))))
            assert [r.policy for r in mm.reports[1:]] == ["planned", "planned"]
        assert running, "the plan started no eviction early"
        assert (sum(running) == 0) == count


def test_a_full_replay_makes_room_for_each_restore_of_its_plan_before_it_starts(
    tmp_path, monkeypatch
):
    # NOTE [room for restores]: the plan's restores start as a step begins, before any
    # reading; a full replay has the guard make room for each first. A lean replay does not.
    from vtensor.activations.replay.executor import PlanExecutor
    from vtensor.activations.runtime.iteration import Iteration
    from vtensor.activations.store.chunk_store import ChunkStore

    events: list[tuple[str, int]] = []  # ("room", bytes) and ("restore", bytes), in order
    in_plan = [False]
    on_step, make_room, restore = PlanExecutor.on_step, Iteration.make_room, ChunkStore.restore

    def stepping(self, index, name, *room):
        in_plan[0] = True
        try:
            on_step(self, index, name, *room)
        finally:
            in_plan[0] = False

    def rooming(self, nbytes):
        events.append(("room", nbytes))
        make_room(self, nbytes)

    def restoring(self, record):
        if in_plan[0]:
            events.append(("restore", sum(c.nbytes for c in record.offloaded_chunks())))
        restore(self, record)

    monkeypatch.setattr(PlanExecutor, "on_step", stepping)
    monkeypatch.setattr(Iteration, "make_room", rooming)
    monkeypatch.setattr(ChunkStore, "restore", restoring)
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(4096, 64)
    budget = _budget(model, x, 0.6)
    ref = _run(model, x, None)
    with vtensor.MemoryManager(budget, chunk_bytes=65536, storage_dir=tmp_path) as mm:
        for _ in range(3):  # profiled, a full replay, a lean one
            events.clear()
            assert all(map(torch.equal, ref, _run(model, x, mm, inputs=(x,))))
            if len(mm.reports) == 2:
                full = list(events)
        assert [r.lean for r in mm.reports] == [False, False, True]
    restores = [i for i, (what, _) in enumerate(full) if what == "restore"]
    assert restores, full
    assert all(i > 0 and full[i - 1] == ("room", full[i][1]) for i in restores), full
    assert events and all(what == "restore" for what, _ in events), events  # lean: no room


def test_a_trace_whose_floor_is_over_a_budget_the_run_meets_is_planned_at_that_floor(tmp_path):
    # NOTE [floor over the budget]: the LSTM's trace puts its floor at its forward (its saved
    # workspace with the step's largest unmanaged bytes), about twice what the iteration
    # states; between the two, the manager ran reactively where it now replays a plan.
    from benchmarks.zoo import ZOO
    from vtensor.planner.lgm import build_lgm, min_budget

    entry, chunk = ZOO["lstm"], 64 * 1024

    def train(mm: vtensor.MemoryManager | None, steps: int) -> list[list[torch.Tensor]]:
        torch.manual_seed(0)
        model = entry.build()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        grads = []
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            with mm.step(model, opt) if mm is not None else torch.enable_grad():
                inputs, targets = entry.make_batch(entry.batch_size, seed=step)
                entry.loss(model(inputs), targets).backward()
            grads.append(_grads(model))
            opt.step()
        return grads

    with vtensor.MemoryManager("1TiB", storage_dir=tmp_path, chunk_bytes=chunk) as probe:
        train(probe, 2)  # the second iteration holds the momentum
        assert probe.trace is not None
        floor = min_budget(build_lgm(probe.trace, chunk))[0]
        stated = probe.report().min_budget_bytes
    assert stated < floor, "the trace's floor is no longer over the stated minimum"
    budget = (stated + floor) // 2
    with vtensor.MemoryManager(budget, storage_dir=tmp_path, chunk_bytes=chunk) as mm:
        grads = train(mm, 4)
    plan = mm.plan_for(entry.build())
    assert [r.plan_source.value for r in mm.reports[1:]] == ["planned"] * 3
    assert plan is not None and plan.budget_bytes > budget  # at the floor where it is over
    assert all(r.peak_device_bytes <= budget + chunk for r in mm.reports)
    for want, got in zip(train(None, 4), grads, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
