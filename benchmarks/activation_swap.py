"""Activation swapping under a budget: LGM-planned chunks vs whole tensors, reactive, checkpointing.

Trains three CPU workloads (``benchmarks/zoo/workloads.py``: a MobileNetV2, a ResNet-18, a
causal char transformer that saves its T x T attention probabilities) at budgets that are
fractions of each model's unmanaged tracked peak, with these variants:

- ``unmanaged``: plain PyTorch, the reference;
- ``checkpoint``: ``torch.utils.checkpoint`` per block (takes no budget: run once, as is);
- ``selective``: selective activation checkpointing per block (torch's
  ``create_selective_checkpoint_contexts``): convolution and matrix-product outputs are saved,
  the rest recomputed;
- ``lgm-chunk``: ``MemoryManager(policy="planned", granularity="chunk")``: the first iteration is
  profiled (reactive), planned by the LGM planner, and the plan is replayed afterwards;
- ``lgm-tensor``: the same planner at ``granularity="tensor"`` (whole tensors, the prior-work
  baseline);
- ``lgm-hybrid``: ``lgm-chunk`` with ``recompute=True``: the plan may also recompute modules
  (NOTE [hybrid plan]); the profile's calibrated model predicts each candidate recomputation's
  step against swapping alone and the least is kept, in at most three iterations (NOTE [one
  decision]);
- ``reactive-chunk``: ``MemoryManager(policy="reactive")``, no planning;
- ``lgm-chunk+masks``, ``lgm-hybrid+masks``: those with ``encode_masks=True`` (clamps save
  their output instead of their input; NOTE [mask encoding]); ``lgm-chunk+auto``,
  ``lgm-hybrid+auto``: with ``encode_masks="auto"`` (encoded where the plan moves bytes);
- ``unbound``: ``lgm-chunk`` with a budget that never binds: the manager's own cost;
- ``micro-2``, ``micro-4``: the batch in 2 or 4 micro-batches with gradient accumulation (the
  same mean loss; not bit-identical: BatchNorm sees smaller batches and the gradient sums in
  another order, so their "grads identical" column says no).
- ``compile``: ``torch.compile`` (inductor) with ``activation_memory_budget`` set to the budget
  fraction, one per budget (``benchmarks/compiled.py``; not bit-identical; its first step compiles
  and is timed apart; its peak is an RSS figure, since the manager cannot track its buffers).

Per variant it measures the median step time over round-robin interleaved rounds after the
profiling round, its kernel time, minor page faults and heap-counter readings (count and time)
per step, bytes moved, the kept plan's recomputation (its units' cost as the profile measured
it), stall, the tracked peak and the independent ones (RSS, and a
``LiveStorageTracker`` on one extra step, which counts live storages and reads the page tables
for the pages released in place), the planner's predicted peak and stall, the planning time,
the time to load the plan from the plan cache, and whether the gradients are bit-identical to
the unmanaged run on every round. A planner micro-benchmark times ``plan_lgm`` on a synthetic
1000-step trace. Infeasible budgets become rows with the stated minimum budget. The comparison
lines set LGM-chunk against LGM-tensor and checkpointing, and each hybrid variant against
unmanaged, LGM-chunk with the same encoding, checkpointing, ``torch.compile`` and the fastest
alternative whose peak fits its budget.

Run from the repository root::

    python -m benchmarks.activation_swap                        # full run
    python -m benchmarks.activation_swap --quick                # CI-sized (< 1 min)
    python -m benchmarks.activation_swap --models mobilenet gpt --out results.jsonl

The script re-executes itself with ``MALLOC_MMAP_THRESHOLD_=65536`` when that variable is unset,
so that RSS follows the live bytes (see NOTE [honest RSS] in ``vtensor/measure/rss.py``).
"""

import argparse
import contextlib
import copy
import functools
import gc
import os
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

import vtensor
from benchmarks.activation_tables import (
    comparisons,
    median_or_none,
    print_comparisons,
    recomputed_seconds,
    table,
)
from benchmarks.common import (
    add_default_malloc,
    add_out,
    add_quick,
    add_repeats,
    describe,
    environment,
    reexec_with_honest_rss,
    repeats,
    tagged,
    write_json_lines,
)
from benchmarks.compiled import compile_under_budget, rss_step_peak
from benchmarks.zoo import Workload, workloads
from vtensor.activations.plan.keys import planner_version
from vtensor.measure.dispatch import LiveStorageTracker
from vtensor.measure.rss import rss_is_honest
from vtensor.measure.trackers import MallocTracker
from vtensor.planner.belady import plan_lgm
from vtensor.planner.cache import PlanCache
from vtensor.planner.keys import plan_key
from vtensor.planner.lgm import build_lgm, min_budget
from vtensor.planner.memory_model import simulate
from vtensor.planner.recomputed import whole_s
from vtensor.planner.trace import Phase, Trace, TraceStep, TraceTensor

MIB = 1 << 20
HUGE_BUDGET = 1 << 40
BASELINES: dict[str, tuple[bool | str, int]] = {  # variant -> (checkpoint_blocks, micro-batches)
    "unmanaged": (False, 1),
    "checkpoint": (True, 1),
    "selective": ("selective", 1),
    "micro-2": (False, 2),
    "micro-4": (False, 4),
}
MANAGED: dict[str, tuple[str, str, bool, bool | str]] = {  # variant -> (policy, granularity,
    # recompute, encode_masks)
    "lgm-chunk": ("planned", "chunk", False, False),
    "lgm-tensor": ("planned", "tensor", False, False),
    "lgm-hybrid": ("planned", "chunk", True, False),
    "reactive-chunk": ("reactive", "chunk", False, False),
    "lgm-chunk+masks": ("planned", "chunk", False, True),
    "lgm-hybrid+masks": ("planned", "chunk", True, True),
    "lgm-chunk+auto": ("planned", "chunk", False, "auto"),
    "lgm-hybrid+auto": ("planned", "chunk", True, "auto"),
}
VARIANTS = [*(n for n in BASELINES if n != "unmanaged"), "unbound", *MANAGED, "compile"]


@dataclass
class Variant:
    """One configuration being timed: its own model copy, optimizer and (maybe) manager."""

    name: str
    budget_frac: float | None
    model: nn.Module
    optimizer: torch.optim.Optimizer
    manager: vtensor.MemoryManager | None = None
    cache_dir: str | None = None
    error: str | None = None
    min_budget_bytes: int | None = None
    step_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    sys_s: list[float] = field(default_factory=list)  # kernel time (page faults, I/O)
    minor_faults: list[int] = field(default_factory=list)
    heap_reads: list[int] = field(default_factory=list)  # heap-counter readings per step
    heap_read_s: list[float] = field(default_factory=list)  # and the time they took
    reports: list[vtensor.IterationReport] = field(default_factory=list)
    grads_identical: list[bool] = field(default_factory=list)
    dispatch_peak: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    micro: int = 1  # micro-batches with gradient accumulation (a baseline)
    # Unit name -> its cost recomputed whole, from the first profile that measured them
    # (a hybrid's reprofile runs without the units).
    units: dict[str, float] = field(default_factory=dict)


class HeapReads:
    """Counts and times every heap-counter reading (``MallocTracker.current_bytes``) in-process.

    A reading walks every free chunk of every malloc arena, so its cost depends on the whole
    process's heap, other variants' included; the rows report it per step.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.seconds = 0.0

    def install(self) -> None:
        """Wrap the tracker class's reading (this script's process only)."""
        original = MallocTracker.current_bytes

        def timed(tracker: MallocTracker) -> int:
            t0 = time.perf_counter()
            try:
                return original(tracker)
            finally:
                self.calls += 1
                self.seconds += time.perf_counter() - t0

        MallocTracker.current_bytes = timed  # type: ignore[method-assign]


HEAP_READS = HeapReads()


# -- one step -------------------------------------------------------------------------------------
def _run_step(v: Variant, w: Workload, x: torch.Tensor, y: torch.Tensor) -> None:
    """Forward and backward of ``v`` (the optimizer step is separate and untimed)."""
    v.optimizer.zero_grad(set_to_none=True)
    if v.micro > 1:
        # Micro-batches: the same mean loss, accumulated (not bit-identical: BatchNorm sees
        # smaller batches, and the gradient sums in another order). Under a manager (the
        # reference's tracked peak), one managed step per micro-batch.
        for xi, yi in zip(x.chunk(v.micro), y.chunk(v.micro), strict=True):
            with (
                v.manager.step(v.model, v.optimizer, inputs=(xi, yi))
                if v.manager is not None
                else contextlib.nullcontext()
            ):
                (w.loss(v.model, xi, yi) * (len(xi) / len(x))).backward()
        return
    if v.manager is None:
        w.loss(v.model, x, y).backward()
        return
    with v.manager.step(v.model, v.optimizer, inputs=(x, y)):
        w.loss(v.model, x, y).backward()


def _state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    for state in opt.state.values():
        tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
    return tensors


def _dispatch_peak(v: Variant, w: Workload, x: torch.Tensor, y: torch.Tensor) -> int:
    """Peak of distinct live CPU storages over one step of ``v`` (LiveStorageTracker)."""
    v.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    tracker = LiveStorageTracker("cpu")
    tracker.track(*_state_tensors(v.model, v.optimizer), x, y)
    with tracker:
        tracker.reset_peak()
        _run_step(v, w, x, y)
    return tracker.peak_bytes


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _same_grads(model: nn.Module, ref: list[torch.Tensor | None]) -> bool:
    return all(
        (p.grad is None and r is None)
        or (p.grad is not None and r is not None and torch.equal(p.grad, r))
        for p, r in zip(model.parameters(), ref, strict=True)
    )


def _make_opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


# -- machine --------------------------------------------------------------------------------------
def _cpu_ticks() -> dict[str, int]:
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return {n: int(v) for n, v in zip(names, fields, strict=False)}


def _tick_fracs(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    ticks = {k: after[k] - before[k] for k in before}
    total = max(1, sum(ticks.values()))
    return {
        "steal_frac": ticks["steal"] / total,
        "idle_frac": ticks["idle"] / total,
        "iowait_frac": ticks["iowait"] / total,
    }


# -- planner micro-benchmark ----------------------------------------------------------------------
def synthetic_trace(n_tensors: int, chunk_bytes: int | None) -> Trace:
    """2 x n_tensors steps: forward saves one 0.5-7.5 MiB tensor per step, backward uses them."""
    rng = np.random.default_rng(0)
    n = 2 * n_tensors
    steps = tuple(
        TraceStep(i, f"step:{i}", Phase.OTHER, 0.002, 0, 0, int(u))
        for i, u in enumerate(rng.integers(2**24, 2**25, size=n))
    )
    tensors = tuple(
        TraceTensor(i, int(rng.integers(1, 16)) * 2**19, ("float32",), i, i + 1, (n - 1 - i,))
        for i in range(n_tensors)
    )
    return Trace(steps, tensors, 0, 0, 0, chunk_bytes, "cpu")


def planner_benchmark(repeats: int) -> list[dict[str, Any]]:
    """Best-of-``repeats`` ``plan_lgm`` time on a 1000-step trace at several budgets."""
    rows = []
    for chunk, frac in ((MIB, 0.2), (MIB, 0.5), (MIB, 0.8), (None, 0.5)):
        trace = synthetic_trace(500, chunk)
        floor, _ = min_budget(build_lgm(trace, chunk))
        peak = max(simulate(plan_lgm(trace, 2**62), trace))
        budget = floor + int(frac * (peak - floor))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            plan = plan_lgm(trace, budget)
            times.append(time.perf_counter() - t0)
        rows.append(
            {
                "steps": len(trace.steps),
                "tensors": len(trace.tensors),
                "chunk_bytes": chunk,
                "budget_between_floor_and_peak": frac,
                "plan_s_best": min(times),
                "plan_s_median": statistics.median(times),
                "moves": len(plan.moves),
            }
        )
    return rows


# -- one model ------------------------------------------------------------------------------------
def _reference(
    w: Workload, base: nn.Module, mode: tuple[bool | str, int], storage_dir: str
) -> dict[str, Any]:
    """Tracked, RSS and dispatch-mode peaks of one unmanaged (checkpointed, micro-batched) step."""
    model = copy.deepcopy(base)
    model.checkpoint_blocks = mode[0]
    probe = Variant("probe", None, model, _make_opt(model), micro=mode[1])
    x, y = w.batch(0)
    _run_step(probe, w, x, y)  # warm-up: one-time allocations (oneDNN caches, optimizer state)
    probe.optimizer.step()
    dispatch = _dispatch_peak(probe, w, x, y)
    probe.manager = vtensor.MemoryManager(  # what torch saves: no encodings
        HUGE_BUDGET,
        storage_dir=storage_dir,
        policy="reactive",
        measure_peaks=True,
        encode_masks=False,
    )
    tracked = rss = 0
    try:
        for _ in range(2):
            _run_step(probe, w, x, y)
            rep = probe.manager.report()
            tracked, rss = (
                max(tracked, rep.peak_device_bytes),
                max(rss, rep.peak_independent_bytes),
            )
    finally:
        probe.manager.close()
    return {"tracked": tracked, "rss": rss, "dispatch": dispatch}


def _make_variants(
    w: Workload,
    base: nn.Module,
    p0: int,
    args: argparse.Namespace,
    storage_dir: str,
    cache_root: str,
) -> list[Variant]:
    variants = []
    for name, (ckpt, micro) in BASELINES.items():
        if name not in args.variants:
            continue
        model = copy.deepcopy(base)
        model.checkpoint_blocks = ckpt
        variants.append(Variant(name, None, model, _make_opt(model), micro=micro))
    if "unbound" in args.variants:
        # The manager's own cost: a budget that never binds, so its plan moves nothing.
        model = copy.deepcopy(base)
        unbound = vtensor.MemoryManager(HUGE_BUDGET, storage_dir=storage_dir, measure_peaks=True)
        variants.append(Variant("unbound", None, model, _make_opt(model), manager=unbound))
    for frac in args.budgets:
        for name, (policy, granularity, recompute, masks) in MANAGED.items():
            if name not in args.variants:
                continue
            model = copy.deepcopy(base)
            v = Variant(name, frac, model, _make_opt(model))
            if policy == "planned":
                v.cache_dir = os.path.join(cache_root, f"{w.name}-{name}-{frac}")
            v.manager = vtensor.MemoryManager(
                int(p0 * frac),
                chunk_bytes=args.chunk_bytes,
                storage_dir=storage_dir,
                granularity=granularity,
                policy=policy,
                recompute=recompute,
                encode_masks=masks,
                plan_cache_dir=v.cache_dir,
                measure_peaks=True,  # the RSS column (resets VmHWM: a benchmark may)
                offload_params=False,  # activations only: parameters stay (``param_offload``)
            )
            variants.append(v)
        if "compile" in args.variants:
            # Not bit-identical, and its peak is an RSS figure (benchmarks/compiled.py).
            model = copy.deepcopy(base)
            compiled = compile_under_budget(model, frac)
            variants.append(Variant("compile", frac, compiled, _make_opt(compiled)))
    return variants


def _timed_round(variants: list[Variant], w: Workload, r: int) -> None:
    """Round ``r`` over every live variant in a fixed order (round 0 is the profiling round)."""
    x, y = w.batch(r)
    ref: list[torch.Tensor | None] = []
    for v in variants:
        if v.error is not None:
            continue
        gc.collect()
        u0 = resource.getrusage(resource.RUSAGE_SELF)
        reads0, read_s0 = HEAP_READS.calls, HEAP_READS.seconds
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            _run_step(v, w, x, y)
        except vtensor.InfeasibleBudgetError as exc:
            v.error = f"InfeasibleBudgetError: {exc}"
            v.min_budget_bytes = exc.min_budget_bytes
            v.extra["failed_round"] = r
            print(
                f"#   {v.name} at {v.budget_frac:.0%}: infeasible in round {r} "
                f"(min budget {exc.min_budget_bytes / MIB:.1f} MiB)",
                flush=True,
            )
            continue
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        u1 = resource.getrusage(resource.RUSAGE_SELF)
        if r == 0 and v.name == "compile":
            v.extra["compile_s"] = dt  # the first call compiles
        if v.name == "unmanaged":
            ref = _grads(v.model)
        else:
            v.grads_identical.append(_same_grads(v.model, ref))
        v.optimizer.step()
        profiled = False
        if v.manager is not None:
            v.reports.append(v.manager.report())
            trace = v.manager.trace
            if not v.units and trace is not None and trace.units:
                v.units = {u.name: whole_s(u) for u in trace.units}
            # A hybrid's reprofile is profiled too.
            profiled = v.reports[-1].plan_source == "profiled"
        if r > 0 and not profiled:
            v.step_s.append(dt)
            v.cpu_s.append(dc)
            v.sys_s.append(u1.ru_stime - u0.ru_stime)
            v.minor_faults.append(u1.ru_minflt - u0.ru_minflt)
            v.heap_reads.append(HEAP_READS.calls - reads0)
            v.heap_read_s.append(HEAP_READS.seconds - read_s0)


def _after_rounds(
    variants: list[Variant], w: Workload, refs: dict[str, dict[str, Any]], r: int
) -> None:
    """Dispatch-mode peaks on one extra step; plan-cache load time of the LGM variants."""
    x, y = w.batch(r)
    for v in variants:
        if v.error is not None:
            continue
        if v.name in ("unmanaged", "compile"):
            # The compiled graph's peak from outside; unmanaged the same way, to set it against.
            v.optimizer.zero_grad(set_to_none=True)
            live = sum(t.untyped_storage().nbytes() for t in _state_tensors(v.model, v.optimizer))
            v.extra["rss_step_peak_bytes"] = rss_step_peak(
                functools.partial(_run_step, v, w, x, y), live + x.nbytes + y.nbytes
            )
        if v.manager is None:
            v.dispatch_peak = refs[v.name]["dispatch"] if v.name in refs else None
            continue
        # The tracker reads the page tables, so it sees pages released in place too.
        v.dispatch_peak = _dispatch_peak(v, w, x, y)
        if v.cache_dir is not None:
            key = plan_key(
                v.model,
                (x, y),
                budget_bytes=v.manager.budget_bytes,
                chunk_bytes=v.manager.chunk_size,
                planner_version=planner_version(False, *MANAGED[v.name][2:]),
            )
            cache = PlanCache(v.cache_dir)
            loads, hit = [], True
            for _ in range(10):
                hit &= cache.get(key) is not None
                loads.append(cache.last_load_s)
            v.extra["cache_hit"] = hit
            v.extra["cache_load_s_median"] = statistics.median(loads)
            if hit:
                v.extra["cache_entry_bytes"] = cache.path_for(key).stat().st_size
        v.extra["recomputed_modules"] = len(v.reports[-1].recomputed) if v.reports else 0
        if v.reports:
            last = v.reports[-1]
            v.extra["recomputed_s"] = recomputed_seconds(v.units, list(last.recomputed))
        if v.manager.trace is not None:
            v.extra["trace_steps"] = len(v.manager.trace.steps)
            v.extra["trace_tensors"] = len(v.manager.trace.tensors)


def _short_of_timed(variants: list[Variant], count: int) -> bool:
    """Whether a variant still running has fewer than ``count`` timed rounds."""
    return any(v.error is None and len(v.step_s) < count for v in variants)


def run_model(
    w: Workload, args: argparse.Namespace, storage_dir: str, cache_root: str
) -> list[dict[str, Any]]:
    """Every variant and budget of one workload; returns the JSON rows."""
    torch.manual_seed(0)
    load_before, ticks_before, started = (
        os.getloadavg(),
        _cpu_ticks(),
        time.perf_counter(),
    )
    print(f"# {w.name}: {w.describe}", flush=True)
    base = w.build()
    refs = {
        name: _reference(w, base, mode, storage_dir)
        for name, mode in BASELINES.items()
        if name in args.variants
    }
    ref = refs["unmanaged"]
    p0 = ref["tracked"]
    print(
        f"#   unmanaged peak: tracked {p0 / MIB:.1f} MiB, dispatch {ref['dispatch'] / MIB:.1f} "
        f"MiB, RSS {ref['rss'] / MIB:.1f} MiB",
        flush=True,
    )
    variants = _make_variants(w, base, p0, args, storage_dir, cache_root)
    # Round 0 profiles; then --steps rounds, and more (at most twice as many) while a live
    # variant has fewer than --min-timed timed rounds: a hybrid's reprofile is not timed.
    r, last = 0, args.steps * (3 if args.min_timed else 1)
    while r <= args.steps or (r <= last and _short_of_timed(variants, args.min_timed)):
        _timed_round(variants, w, r)
        print(f"#   round {r} done at {time.perf_counter() - started:.0f} s", flush=True)
        r += 1
    _after_rounds(variants, w, refs, r)
    for v in variants:
        if v.manager is not None:
            v.manager.close()
    machine = {
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "wall_s": time.perf_counter() - started,
        "rss_honest": rss_is_honest(),
        **_tick_fracs(ticks_before, _cpu_ticks()),
    }
    unmanaged_s = statistics.median(variants[0].step_s)
    return [_row(v, w, p0, refs, args, machine, unmanaged_s) for v in variants]


def _row(
    v: Variant,
    w: Workload,
    p0: int,
    refs: dict[str, dict[str, Any]],
    args: argparse.Namespace,
    machine: dict[str, Any],
    unmanaged_s: float,
) -> dict[str, Any]:
    timed = [rep for rep in v.reports[1:] if rep.plan_source != "profiled"]
    row: dict[str, Any] = {
        "model": w.name,
        "model_description": w.describe,
        "variant": v.name,
        "budget_frac": v.budget_frac,
        "unmanaged_tracked_peak_bytes": p0,
        "budget_bytes": None if v.manager is None else v.manager.budget_bytes,
        "chunk_bytes": None if v.manager is None else v.manager.chunk_size,
        "error": v.error,
        "min_budget_bytes": v.min_budget_bytes,
        "dispatch_peak_bytes": v.dispatch_peak,
        "step_s_median": median_or_none(v.step_s),
        "step_s_all": v.step_s,
        "cpu_s_median": median_or_none(v.cpu_s),
        "sys_s_median": median_or_none(v.sys_s),
        "minor_faults_median": median_or_none([float(n) for n in v.minor_faults]),
        "heap_reads_median": median_or_none([float(n) for n in v.heap_reads]),
        "heap_read_s_median": median_or_none(v.heap_read_s),
        "steps_timed": len(v.step_s),
        # The decision's profiled rounds: the profile and the reprofile.
        "decision_steps": sum(rep.plan_source == "profiled" for rep in v.reports),
        "vs_unmanaged": None if not v.step_s else statistics.median(v.step_s) / unmanaged_s,
        "grads_identical": True
        if v.name == "unmanaged"
        else (all(v.grads_identical) if v.grads_identical else None),
        "grads_checked_rounds": len(v.grads_identical),
        "extra": v.extra,
        "machine": machine,
    }
    if v.name == "compile":
        row.update(
            budget_bytes=int(p0 * v.budget_frac) if v.budget_frac else None,
            tracked_peak_bytes=None,  # its buffers are not tracked: the RSS figure stands in
            rss_peak_bytes=v.extra.get("rss_step_peak_bytes"),
            bytes_out_per_step=0,
            bytes_in_per_step=0,
            stall_s_median=0.0,
        )
        return row
    if v.manager is None:
        r = refs[v.name]
        row.update(
            tracked_peak_bytes=r["tracked"],
            rss_peak_bytes=r["rss"],
            bytes_out_per_step=0,
            bytes_in_per_step=0,
            stall_s_median=0.0,
        )
        return row
    row.update(
        tracked_peak_bytes=max((rep.peak_device_bytes for rep in v.reports), default=None),
        timed_tracked_peak_bytes=max((rep.peak_device_bytes for rep in timed), default=None),
        rss_peak_bytes=max((rep.peak_independent_bytes or 0 for rep in v.reports), default=None),
        bytes_out_per_step=median_or_none([rep.bytes_out for rep in timed]),
        bytes_in_per_step=median_or_none([rep.bytes_in for rep in timed]),
        copied_bytes_per_step=median_or_none([rep.copied_bytes for rep in timed]),
        bytes_out_all=[rep.bytes_out for rep in v.reports],
        bytes_in_all=[rep.bytes_in for rep in v.reports],
        stall_s_median=median_or_none([rep.stall_s for rep in timed]),
        transfer_s_median=median_or_none([rep.transfer_s for rep in timed]),
        plan_sources=[rep.plan_source for rep in v.reports],
        policies=[rep.policy for rep in v.reports],
        planning_s=max((rep.planning_s for rep in v.reports), default=None),
        predicted_peak_bytes=next(
            (rep.predicted_peak_bytes for rep in timed if rep.predicted_peak_bytes is not None),
            None,
        ),
        predicted_stall_s=next(
            (rep.predicted_stall_s for rep in timed if rep.predicted_stall_s is not None),
            None,
        ),
        min_budget_seen_bytes=max((rep.min_budget_bytes for rep in v.reports), default=None),
    )
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_quick(p, "small models, one budget, one timed round; < 1 min")
    p.add_argument(
        "--models",
        nargs="+",
        default=["mobilenet", "resnet", "gpt"],
        choices=["mobilenet", "resnet", "gpt"],
        help="which workloads to run",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed rounds after the profiling round (default 5; quick: 1)",
    )
    p.add_argument(
        "--min-timed",
        type=int,
        default=0,
        help="after --steps rounds, run more (at most twice --steps) until every variant has "
        "this many timed rounds (a hybrid's reprofile is not timed); default 0",
    )
    p.add_argument("--batch-scale", type=float, default=1.0, help="scale every batch size")
    p.add_argument(
        "--budgets",
        type=float,
        nargs="+",
        default=None,
        help="budgets as fractions of the unmanaged tracked peak "
        "(default 0.8 0.6 0.4 0.25; quick: 0.6)",
    )
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (1 recommended on a shared host)",
    )
    p.add_argument("--storage-dir", default=None, help="directory of the swap files")
    p.add_argument(
        "--variants",
        nargs="+",
        default=None,
        choices=VARIANTS,
        metavar="VARIANT",
        help=f"which variants to run besides unmanaged, the reference (default all; quick: all "
        f"but compile, which takes up to a minute per budget to compile): {' '.join(VARIANTS)}",
    )
    add_repeats(p, "best-of repeats of the planner micro-benchmark", full=5, quick=2)
    add_default_malloc(p)
    add_out(p)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 1 if args.quick else 5
    if args.budgets is None:
        args.budgets = [0.6] if args.quick else [0.8, 0.6, 0.4, 0.25]
    if args.variants is None:
        args.variants = [v for v in VARIANTS if not (args.quick and v == "compile")]
    args.variants = ["unmanaged", *args.variants]
    torch.set_num_threads(args.threads)
    HEAP_READS.install()
    storage_dir = args.storage_dir or tempfile.gettempdir()
    env = environment(cuda=torch.cuda.is_available())
    load = env["load_avg"]
    print(describe(env))
    print(
        f"# {args.steps} timed rounds after the profiling round, variants interleaved round-robin",
        flush=True,
    )
    started = time.perf_counter()
    planner = planner_benchmark(repeats(args, full=5, quick=2))
    for pr in planner:
        chunk = "tensor" if pr["chunk_bytes"] is None else f"{pr['chunk_bytes'] // 1024} KiB"
        print(
            f"# plan_lgm, {pr['steps']} steps x {pr['tensors']} tensors, {chunk}, budget "
            f"floor+{pr['budget_between_floor_and_peak']}: best "
            f"{pr['plan_s_best'] * 1e3:.0f} ms, {pr['moves']} moves",
            flush=True,
        )
    rows, comps = [], []
    all_workloads = workloads(args.quick, args.batch_scale)
    with tempfile.TemporaryDirectory(prefix="plan-cache-") as cache_root:
        for name in args.models:
            model_rows = run_model(all_workloads[name], args, storage_dir, cache_root)
            rows += model_rows
            comps += comparisons(model_rows)
            print(f"\n## {name}: {model_rows[0]['model_description']}\n")
            print(table(model_rows) + "\n", flush=True)
    print_comparisons(comps, rows)
    end = {
        "kind": "end",
        "load_avg": os.getloadavg(),
        "wall_s": time.perf_counter() - started,
    }
    print(
        f"# load average at start {load[0]:.2f}, at end {end['load_avg'][0]:.2f}; "
        f"total {end['wall_s']:.0f} s"
    )
    results = [*tagged("planner", planner), *tagged("variant", rows)]
    write_json_lines(args.out, env, [*results, *tagged("comparison", comps), end])


if __name__ == "__main__":
    reexec_with_honest_rss()
    main()
