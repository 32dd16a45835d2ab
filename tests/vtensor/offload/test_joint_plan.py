"""One plan for activations, parameters, gradients and optimizer state under one budget.

NOTE [one plan] in ``vtensor/offload/joint.py``: ``mm.step(model, inputs, params=po)`` records the
parameter side in the trace, plans it with the activations and replays both. The planner
tests check the memory model of persistent, whole tensors on random traces; the training tests
check that a transformer whose parameters + gradients + AdamW state + activations exceed the
budget trains bit-identically with the plan replayed, and that a fresh process uses the cached
joint plan.
"""

import contextlib
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import vtensor
from vtensor.errors import VTensorError
from vtensor.planner.belady import plan_lgm
from vtensor.planner.lgm import build_lgm, min_budget
from vtensor.planner.memory_model import check_plan, predict_stalls, simulate, writing_moves
from vtensor.planner.plan import Plan, TensorMove
from vtensor.planner.trace import Phase, Trace, TraceStep, TraceTensor

CHUNK_BYTES = 64 * 1024
VOCAB, SEQ, BATCH, DIM, DEPTH = 256, 32, 8, 128, 3
STEPS = 5


# -- the planner on persistent tensors ------------------------------------------------------


def _trace(unmanaged: list[int], tensors: list[TraceTensor], chunk: int | None = 1000) -> Trace:
    steps = tuple(
        TraceStep(i, f"step:{i}", Phase.OTHER, 0.01, 0, 0, u) for i, u in enumerate(unmanaged)
    )
    return Trace(steps, tuple(tensors), 0, 0, 0, chunk, "cpu")


def _param(vid: int, nbytes: int, uses: tuple[int, ...], dirty: int = -1) -> TraceTensor:
    return TraceTensor(vid, nbytes, ("float32",), 0, 0, uses, "param", f"p{vid}", True, True, dirty)


def _layered(depth: int) -> Trace:
    """A deep net: layer i's weights used at forward step i and backward step 2*depth-1-i
    (where they are also updated), its activation saved at i and used in backward."""
    n = 2 * depth
    tensors: list[TraceTensor] = []
    for i in range(depth):
        back = n - 1 - i
        tensors.append(TraceTensor(i, 3000, ("float32",), i, i + 1, (back,)))
    for i in range(depth):
        back = n - 1 - i
        tensors.append(_param(depth + i, 2000, (i, back), dirty=back))
    return _trace([500] * n, tensors)


def test_plan_lgm_keeps_persistent_tensors_away_across_the_iteration_boundary() -> None:
    trace = _layered(4)
    total = int(max(simulate(Plan(0, 1000, (), (), (), 0, 0.0, ""), trace)))
    floor, _ = min_budget(build_lgm(trace, 1000))
    plan = plan_lgm(trace, (floor + total) // 2)
    assert check_plan(plan, trace, plan.budget_bytes) == []
    params = {t.vid for t in trace.tensors if t.persistent}
    param_moves = [m for m in plan.moves if m.vid in params]
    assert param_moves, "the budget is below the resident total: weights must move too"
    for m in param_moves:
        assert m.evict_bytes == trace.tensors[m.vid].nbytes, "parameters move whole"
    n = len(trace.steps)
    for vid in {m.vid for m in param_moves if m.prefetch_step == n}:
        # Away at the end of one iteration means away at the start of the next.
        assert any(m.vid == vid and m.evict_step == 0 for m in param_moves)
    assert plan.tensor_names[: len(params)] == ("",) * len(params)
    assert Plan.from_json(plan.to_json()) == plan


def test_check_plan_refuses_a_persistent_tensor_that_does_not_close_its_cycle() -> None:
    trace = _trace([0] * 4, [_param(0, 2000, (1,))])
    broken = Plan(10_000, 1000, (TensorMove(0, 2000, 2, 4),), tuple(f"step:{i}" for i in range(4)),
                  (2000,), 0, 0.0, "", tensor_names=("p0",))  # fmt: skip
    assert any("start" in p for p in check_plan(broken, trace, 10_000))
    closed = Plan(10_000, 1000, (TensorMove(0, 2000, 0, 1), TensorMove(0, 2000, 2, 4)),
                  broken.step_names, (2000,), 0, 0.0, "", tensor_names=("p0",))  # fmt: skip
    assert check_plan(closed, trace, 10_000) == []


def test_only_the_first_eviction_after_a_change_writes() -> None:
    # Used at 1 and 4, changed at 4: of the windows [0,1), [2,4) and [5,6) only the one after
    # the change writes; the others drop the copy the tier already holds.
    trace = _trace([0] * 6, [_param(0, 4000, (1, 4), dirty=4)], chunk=None)
    moves = (TensorMove(0, 4000, 0, 1), TensorMove(0, 4000, 2, 4), TensorMove(0, 4000, 5, 6))
    plan = Plan(0, None, moves, tuple(f"step:{i}" for i in range(6)), (4000,), 0, 0.0, "",
                tensor_names=("p0",))  # fmt: skip
    assert writing_moves(plan, trace) == {moves[2]}
    never_changed = _trace([0] * 6, [_param(0, 4000, (1, 4))], chunk=None)
    assert writing_moves(plan, never_changed) == set()
    # A write that cannot finish in time stalls; a drop costs nothing.
    slow = predict_stalls(plan, trace, write_bytes_per_s=1e3, read_bytes_per_s=1e12)
    assert max(slow[:5]) < 1e-6 and slow[5] > 1.0


@st.composite
def mixed_traces(draw: st.DrawFn) -> Trace:
    n = draw(st.integers(2, 12))
    tensors: list[TraceTensor] = []
    for _ in range(draw(st.integers(0, 5))):
        saved = draw(st.integers(0, n - 1))
        evictable = draw(st.one_of(st.just(-1), st.integers(saved, n - 1)))
        uses = draw(st.lists(st.integers(saved, n - 1), max_size=3, unique=True))
        size = draw(st.integers(1, 5000))
        tensors.append(
            TraceTensor(len(tensors), size, ("f",), saved, evictable, tuple(sorted(uses)))
        )
    for _ in range(draw(st.integers(0, 4))):
        uses = tuple(sorted(draw(st.lists(st.integers(0, n - 1), max_size=3, unique=True))))
        dirty = draw(st.sampled_from([-1, *uses]))
        tensors.append(_param(len(tensors), draw(st.integers(1, 5000)), uses, dirty))
    unmanaged = draw(st.lists(st.integers(0, 3000), min_size=n, max_size=n))
    return _trace(unmanaged, tensors, draw(st.sampled_from([None, 512, 1000])))


@settings(max_examples=150, deadline=None)
@given(mixed_traces(), st.floats(0.0, 1.0))
def test_plan_lgm_with_persistent_tensors_keeps_every_rule(trace: Trace, fraction: float) -> None:
    floor, _ = min_budget(build_lgm(trace, trace.chunk_bytes))
    peak = int(max(simulate(Plan(0, None, (), (), (), 0, 0.0, ""), trace), default=0))
    budget = floor + int(fraction * max(0, peak - floor))
    plan = plan_lgm(trace, budget)
    assert check_plan(plan, trace, budget) == []
    assert plan_lgm(trace, budget) == plan  # deterministic
    assert Plan.from_json(plan.to_json()) == plan
    for m in plan.moves:
        if trace.tensors[m.vid].whole:
            assert m.evict_bytes == trace.tensors[m.vid].nbytes


# -- training under one plan ----------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm block: causal scaled-dot-product attention (4 heads) and a GELU MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(batch, seq, 3, 4, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        out: Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(*(Block() for _ in range(DEPTH)))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        logits: Tensor = self.head(self.ln(self.blocks(self.tok(tokens))))
        return logits


def _build() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


def _batch(i: int) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(i))
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    loss: Tensor = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    return loss


OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1),
}


def _reference(make_opt: str, steps: int, accumulation: int, clip: float | None) -> nn.Module:
    model = _build()
    optimizer = OPTIMIZERS[make_opt](model.parameters())
    for i in range(steps):
        optimizer.zero_grad()
        for k in range(accumulation):
            x, y = _batch(i * accumulation + k)
            (_loss(model, x, y) / accumulation).backward()  # type: ignore[no-untyped-call]
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return model


def _budget(make_opt: str, fraction: float = 0.9) -> int:
    """A fraction of the parameters + gradients + optimizer state (exact bytes, so the same in
    every process): those alone do not fit, and the activations (about 60 % of them at this
    batch) must share what is left."""
    params = sum(p.nbytes for p in _build().parameters())
    state = 2 * params if make_opt == "adamw" else params
    return int(fraction * (2 * params + state))


@contextlib.contextmanager
def _joint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    budget: int,
    storage: Path,
    **offload: Any,
) -> Iterator[tuple[vtensor.ParamOffload, vtensor.MemoryManager]]:
    """A ParamOffload and a MemoryManager with one budget (``mm.step(..., params=po)``)."""
    with (
        vtensor.ParamOffload(
            model, optimizer, budget, chunk_bytes=CHUNK_BYTES, storage_dir=storage, **offload
        ) as po,
        vtensor.MemoryManager(budget, chunk_bytes=CHUNK_BYTES, storage_dir=storage) as mm,
    ):
        yield po, mm


def _backward(
    mm: vtensor.MemoryManager,
    po: vtensor.ParamOffload,
    model: nn.Module,
    batch: int,
    parts: int = 1,
) -> None:
    """One managed forward and backward on batch ``batch`` (loss divided by ``parts``)."""
    x, y = _batch(batch)
    with mm.step(model, inputs=(x,), params=po):
        (_loss(model, x, y) / parts).backward()  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("make_opt", sorted(OPTIMIZERS))
def test_joint_plan_trains_bit_identically_under_one_budget(
    tmp_storage_dir: Path, make_opt: str
) -> None:
    budget = _budget(make_opt)
    model = _build()
    optimizer = OPTIMIZERS[make_opt](model.parameters())
    with _joint(model, optimizer, budget, tmp_storage_dir) as (po, mm):
        for i in range(STEPS):
            _backward(mm, po, model, i)
            po.step()
            report = mm.report()
            assert report.peak_device_bytes <= budget + CHUNK_BYTES, report
        sources = [r.plan_source for r in mm.reports]
        assert sources[-2:] == ["planned", "planned"], sources
        assert all(r.policy == "planned" for r in mm.reports[-2:])
        plan = mm.plan_for(model, inputs=(_batch(0)[0],), params=po)
        assert plan is not None
        names = plan.tensor_names
        kinds = {n.split("#")[1].split(":")[0] if "#" in n else "param" for n in names if n}
        assert {"param", "state"} <= kinds
        assert any(names[m.vid] for m in plan.moves), "parameter-side tensors are planned"
        # Activations are planned with them: the plan's tensors include them (unnamed, first).
        # Whether any of them moves is the planner's choice by the measured step times (one to
        # three of them here, fewer on a loaded machine), so it is not asserted.
        assert names and not names[0] and "" in names, "activations are planned too"
        assert po.report().peak_resident_bytes <= budget
    reference = _reference(make_opt, STEPS, 1, None)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_joint_plan_with_accumulation_and_clipping_is_bit_identical(
    tmp_storage_dir: Path,
) -> None:
    budget = _budget("adamw", 1.1)  # accumulated gradients are kept as well
    model = _build()
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    steps, accumulation, clip = 3, 2, 0.05
    offload = {"accumulation_steps": accumulation, "max_grad_norm": clip}
    with _joint(model, optimizer, budget, tmp_storage_dir, **offload) as (po, mm):
        signatures = set()
        for i in range(steps):
            for k in range(accumulation):
                signatures.add(po.plan_signature())
                _backward(mm, po, model, i * accumulation + k, accumulation)
                assert mm.report().peak_device_bytes <= budget + CHUNK_BYTES
            po.step()
        assert len(signatures) == 2, "first and last micro-batches are planned apart"
        assert [r.plan_source for r in mm.reports[-2:]] == ["planned", "planned"]
    reference = _reference("adamw", steps, accumulation, clip)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


_FRESH_PROCESS = textwrap.dedent(
    """
    import json, sys
    import torch
    sys.path.insert(0, {tests!r})
    import vtensor
    from test_joint_plan import OPTIMIZERS, _batch, _build, _loss, _reference
    model = _build()
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    sources = []
    with vtensor.ParamOffload(model, optimizer, {budget}, chunk_bytes={chunk}) as po, \\
            vtensor.MemoryManager({budget}, chunk_bytes={chunk}, plan_cache_dir={cache!r}) as mm:
        for i in range(3):
            x, y = _batch(i)
            with mm.step(model, inputs=(x,), params=po):
                _loss(model, x, y).backward()
            po.step()
            sources.append(mm.report().plan_source)
    reference = _reference("adamw", 3, 1, None).state_dict()
    identical = all(torch.equal(model.state_dict()[n], t) for n, t in reference.items())
    print(json.dumps({{"sources": sources, "identical": identical}}))
    """
)


def test_a_fresh_process_trains_with_the_cached_joint_plan(tmp_path: Path) -> None:
    budget = _budget("adamw")
    cache = tmp_path / "plans"
    runs = []
    for _ in range(2):
        script = _FRESH_PROCESS.format(
            tests=str(Path(__file__).parent), budget=budget, chunk=CHUNK_BYTES, cache=str(cache)
        )
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    # The first process profiles (twice: its first step creates the AdamW state) and plans.
    assert first["sources"] == ["profiled", "profiled", "planned"], first
    # The second loads the plan before its first step and never profiles.
    assert second["sources"][0] == "cached" and "profiled" not in second["sources"], second
    # Each against unmanaged training in its own process (same threads, same kernels).
    assert first["identical"] and second["identical"]


def test_step_params_needs_one_budget_and_no_optimizer(tmp_storage_dir: Path) -> None:
    model = _build()
    optimizer = OPTIMIZERS["sgd_momentum"](model.parameters())
    x, _ = _batch(0)
    with (
        vtensor.ParamOffload(model, optimizer, "64MiB", storage_dir=tmp_storage_dir) as po,
        vtensor.MemoryManager("32MiB", storage_dir=tmp_storage_dir) as mm,
    ):
        with (
            pytest.raises(VTensorError, match="same budget"),
            mm.step(model, inputs=(x,), params=po),
        ):
            pass
    with (
        vtensor.ParamOffload(model, optimizer, "64MiB", storage_dir=tmp_storage_dir) as po,
        vtensor.MemoryManager("64MiB", storage_dir=tmp_storage_dir) as mm,
    ):
        with pytest.raises(VTensorError, match="leave optimizer out"):
            with mm.step(model, optimizer, (x,), params=po):
                pass
        other = _build()
        with pytest.raises(VTensorError, match="ParamOffload of the model"):
            with mm.step(other, inputs=(x,), params=po):
                pass


def test_plan_signature_covers_the_micro_batch_and_the_clipping(tmp_storage_dir: Path) -> None:
    model = _build()
    optimizer = OPTIMIZERS["sgd_momentum"](model.parameters())
    with vtensor.ParamOffload(
        model, optimizer, "64MiB", accumulation_steps=2, storage_dir=tmp_storage_dir
    ) as po:
        first = po.plan_signature()
        x, y = _batch(0)
        (_loss(model, x, y) / 2).backward()  # type: ignore[no-untyped-call]
        last = po.plan_signature()
        assert "micro-batch=first" in first and "micro-batch=last" in last
        assert "SGD" in first and "clip=none" in first
    with vtensor.ParamOffload(
        model, optimizer, "64MiB", max_grad_norm=1.0, storage_dir=tmp_storage_dir
    ) as po:
        assert "clip=2.0" in po.plan_signature() and "micro-batch=only" in po.plan_signature()


def test_a_forward_outside_the_steps_ends_the_plans_hold(tmp_storage_dir: Path) -> None:
    """Evaluation between joint steps: what the plan kept resident is let go, training goes
    on with the plan and stays bit-identical."""
    budget = _budget("sgd_momentum")
    model = _build()
    optimizer = OPTIMIZERS["sgd_momentum"](model.parameters())
    with _joint(model, optimizer, budget, tmp_storage_dir) as (po, mm):
        for i in range(STEPS):
            _backward(mm, po, model, i)
            po.step()
            if i == STEPS - 2:
                held = po.meter.resident_bytes
                with torch.no_grad():
                    model(_batch(i)[0])
                assert po.pool.listener is None
                assert po.meter.resident_bytes < held
        assert mm.report().plan_source == "planned"
    reference = _reference("sgd_momentum", STEPS, 1, None)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
