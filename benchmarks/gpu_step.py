"""The CUDA path under a budget: vtensor's plans against unmanaged training and checkpointing.

The activation benchmark (``benchmarks/activation_swap.py``) measures the CPU tier (the sealed
swap file); this one measures the CUDA tier (pinned host memory, copies on a side stream) on the
same three workloads (``benchmarks/zoo/workloads.py``), moved to the GPU, side by side in one
process:

- ``unmanaged``: plain PyTorch, the reference;
- ``checkpoint``: ``torch.utils.checkpoint`` per block (takes no budget: run once, as is);
- ``unbound``: a manager whose budget never binds (its own cost);
- ``lgm-tensor``, ``lgm-chunk``, ``lgm-hybrid``: planned whole tensors, chunks, and chunks with
  recomputation, at each budget (a fraction of the unmanaged tracked peak).

On CUDA the script turns on torch's deterministic algorithms (``CUBLAS_WORKSPACE_CONFIG``,
``torch.use_deterministic_algorithms``, no cuDNN autotuning): without them two unmanaged runs
of the same step differ in their last bits, and no variant can be bit-identical to another.
Rounds are interleaved round-robin; each step is timed between two ``torch.cuda.synchronize``
calls (forward and backward; the optimizer step is untimed). Profiled rounds are not
timed. Per row: median step time and its ratio to unmanaged; the tracked peak over every
round, profiling included (the manager's reading: ``torch.cuda.memory_allocated``'s
rise over the step's entry, on top of the state known at entry) and the allocator's peak over
the timed rounds (``torch.cuda.max_memory_allocated``, the manager's independent figure, which
also sees the memory inside ops), both as fractions of the budget; bytes moved per step; the
stall the host waited (on CUDA the host rarely waits: the compute stream does); and whether the
gradients were bit-identical to the unmanaged run's on every round. The JSON rows add each
round's plan source and the number of modules it recomputed.

Run from the repository root on a machine with a CUDA device::

    python -m benchmarks.gpu_step                                   # full run
    python -m benchmarks.gpu_step --models gpt --budgets 0.5 --rounds 12 --out gpu.jsonl
    python -m benchmarks.gpu_step --tier storage    # the sealed swap file, as on a Jetson

``--tier`` picks where the managers' evicted chunks go (NOTE [tier choice] in
``vtensor/io/engines.py``): ``auto`` (pinned host memory on a discrete GPU, the swap file
through pinned staging slots on an integrated one), ``host`` or ``storage``.
"""

import argparse
import copy
import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import vtensor
from benchmarks.activation_swap import _grads, _make_opt, _same_grads
from benchmarks.common import add_out, describe, environment, tagged, write_json_lines
from benchmarks.zoo.workloads import Workload, workloads
from vtensor.io.engines import Tier

MIB = 2**20
HUGE_BUDGET = 1 << 50
DEVICE = torch.device("cuda")  # --device cpu checks the script itself on a machine without one
MANAGED = {  # name -> (granularity, recompute)
    "lgm-tensor": ("tensor", False),
    "lgm-chunk": ("chunk", False),
    "lgm-hybrid": ("chunk", True),
}


@dataclass
class Run:
    """One variant being timed: its own model copy, optimizer and (maybe) manager."""

    name: str
    budget_frac: float | None
    model: nn.Module
    optimizer: torch.optim.Optimizer
    manager: vtensor.MemoryManager | None = None
    error: str | None = None
    step_s: list[float] = field(default_factory=list)
    reports: list[vtensor.IterationReport] = field(default_factory=list)
    timed_reports: list[vtensor.IterationReport] = field(default_factory=list)
    grads_identical: list[bool] = field(default_factory=list)


def _step(run: Run, w: Workload, x: torch.Tensor, y: torch.Tensor) -> None:
    run.optimizer.zero_grad(set_to_none=True)
    if run.manager is None:
        w.loss(run.model, x, y).backward()
        return
    with run.manager.step(run.model, run.optimizer, inputs=(x, y)):
        w.loss(run.model, x, y).backward()


def _batch(w: Workload, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = w.batch(r)
    return x.to(DEVICE), y.to(DEVICE)


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _tracked_peak(w: Workload, base: nn.Module, checkpointed: bool) -> int:
    """The tracked peak of one unmanaged (or checkpointed) step, read by a never-binding manager."""
    model = copy.deepcopy(base)
    model.checkpoint_blocks = checkpointed
    probe = Run("probe", None, model, _make_opt(model))
    x, y = _batch(w, 0)
    _step(probe, w, x, y)  # warm-up: cuDNN/cuBLAS workspaces, optimizer state
    probe.optimizer.step()
    probe.manager = vtensor.MemoryManager(HUGE_BUDGET, policy="reactive", encode_masks=False)
    peak = 0
    try:
        for _ in range(2):
            _step(probe, w, x, y)
            peak = max(peak, probe.manager.report().peak_device_bytes)
    finally:
        probe.manager.close()
    return peak


def _runs(w: Workload, base: nn.Module, p0: int, args: argparse.Namespace) -> list[Run]:
    runs = []
    for name, ckpt in (("unmanaged", False), ("checkpoint", True)):
        model = copy.deepcopy(base)
        model.checkpoint_blocks = ckpt
        runs.append(Run(name, None, model, _make_opt(model)))
    model = copy.deepcopy(base)
    unbound = vtensor.MemoryManager(HUGE_BUDGET, measure_peaks=True, tier=args.tier)
    runs.append(Run("unbound", None, model, _make_opt(model), manager=unbound))
    for frac in args.budgets:
        for name, (granularity, recompute) in MANAGED.items():
            if name not in args.variants:
                continue
            model = copy.deepcopy(base)
            manager = vtensor.MemoryManager(
                int(p0 * frac),
                granularity=granularity,
                recompute=recompute,
                host_capacity_bytes=max(p0, 64 * MIB),
                tier=args.tier,
                measure_peaks=True,  # the allocator's peak (resets it: a benchmark may)
                offload_params=False,  # activations only, on --device cpu too
            )
            runs.append(Run(name, frac, model, _make_opt(model), manager=manager))
    return runs


def _round(runs: list[Run], w: Workload, r: int) -> None:
    x, y = _batch(w, r)
    ref: list[torch.Tensor | None] = []
    for run in runs:
        if run.error is not None:
            continue
        _sync()
        t0 = time.perf_counter()
        try:
            _step(run, w, x, y)
            _sync()
        except vtensor.InfeasibleBudgetError as exc:
            run.error = f"infeasible in round {r}: min budget {exc.min_budget_bytes / MIB:.1f} MiB"
            print(f"#   {run.name} at {run.budget_frac:.0%}: {exc}", flush=True)
            continue
        dt = time.perf_counter() - t0
        if run.name == "unmanaged":
            ref = _grads(run.model)
        else:
            run.grads_identical.append(_same_grads(run.model, ref))
        run.optimizer.step()
        timed = r > 0
        if run.manager is not None:
            run.reports.append(run.manager.report())
            timed = timed and run.reports[-1].plan_source != "profiled"
        if timed:
            run.step_s.append(dt)
            run.timed_reports += run.reports[-1:]


def _row(run: Run, w: Workload, p0: int, unmanaged_s: float | None) -> dict[str, Any]:
    med = statistics.median(run.step_s) if run.step_s else None
    row: dict[str, Any] = {
        "model": w.name,
        "variant": run.name,
        "budget_frac": run.budget_frac,
        "unmanaged_peak_bytes": p0,
        "error": run.error,
        "timed_steps": len(run.step_s),
        "step_s_median": med,
        "vs_unmanaged": med / unmanaged_s if med and unmanaged_s else None,
        "grads_identical": all(run.grads_identical) if run.grads_identical else None,
    }
    if run.reports:
        last = run.reports[-1]
        budget = run.manager.budget_bytes if run.manager is not None else None
        tracked = max(rep.peak_device_bytes for rep in run.reports)
        allocator = max((rep.peak_independent_bytes or 0) for rep in run.reports)
        timed_alloc = max((rep.peak_independent_bytes or 0 for rep in run.timed_reports), default=0)
        row |= {
            "plan_source": str(last.plan_source),
            "tracked_peak_bytes": tracked,
            "allocator_peak_bytes": allocator,  # every round's, profiling included
            "timed_allocator_peak_bytes": timed_alloc or None,  # the timed rounds'
            "sources": [str(rep.plan_source) for rep in run.reports],
            "recomputed_per_round": [len(rep.recomputed) for rep in run.reports],
            "tracked_vs_budget": tracked / budget if budget and budget < HUGE_BUDGET else None,
            "bytes_out_per_step": last.bytes_out,
            "bytes_in_per_step": last.bytes_in,
            "stall_s": last.stall_s,
            "recomputed": list(last.recomputed),
        }
    return row


def run_model(w: Workload, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every variant of ``w`` side by side; one row each."""
    torch.manual_seed(0)
    base = w.build().to(DEVICE)
    p0 = _tracked_peak(w, base, checkpointed=False)
    p_ckpt = _tracked_peak(w, base, checkpointed=True)
    print(f"# {w.describe}: unmanaged peak {p0 / MIB:.1f} MiB, checkpoint {p_ckpt / MIB:.1f} MiB")
    runs = _runs(w, base, p0, args)
    for r in range(args.rounds):
        _round(runs, w, r)
    unmanaged = statistics.median(runs[0].step_s)
    rows = [_row(run, w, p0, unmanaged) for run in runs]
    for row, run in zip(rows, runs, strict=True):
        row["tier"] = args.tier if run.manager is not None else None
        if run.name == "checkpoint":
            row["tracked_peak_bytes"] = p_ckpt
        if run.manager is not None:
            run.manager.close()
    return rows


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _print(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'model':10} {'variant':11} {'budget':>6} {'step ms':>8} {'x unm':>6} "
        f"{'tracked/b':>9} {'alloc/b':>8} {'MiB out':>8} {'stall ms':>8} {'ident':>5} source"
    )
    for row in rows:
        budget = row["budget_frac"]
        b = 1 / (budget * row["unmanaged_peak_bytes"]) if budget else None
        tracked, alloc = row.get("tracked_peak_bytes"), row.get("timed_allocator_peak_bytes")
        print(
            f"{row['model']:10} {row['variant']:11} {_fmt(budget, '.0%'):>6} "
            f"{_fmt(row['step_s_median'], '.1f', 1e3):>8} {_fmt(row['vs_unmanaged'], '.2f'):>6} "
            f"{_fmt(tracked if b else None, '.2f', b or 1):>9} "
            f"{_fmt(alloc if b else None, '.2f', b or 1):>8} "
            f"{_fmt(row.get('bytes_out_per_step'), '.0f', 1 / MIB):>8} "
            f"{_fmt(row.get('stall_s'), '.1f', 1e3):>8} "
            f"{row['grads_identical']!s:>5} {row.get('plan_source', row['error'] or '')}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mobilenet", "resnet", "gpt"])
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.8, 0.5, 0.4])
    parser.add_argument("--variants", nargs="+", default=list(MANAGED), choices=list(MANAGED))
    parser.add_argument("--rounds", type=int, default=30, help="rounds, the profiling one included")
    parser.add_argument("--batch-scale", type=float, default=4.0, help="scales every batch")
    parser.add_argument(
        "--tier", default="auto", choices=[t.value for t in Tier], help="where evictions go"
    )
    add_out(parser)
    parser.add_argument("--device", default="cuda", help="cpu: check the script without a GPU")
    parser.add_argument(
        "--log-level", default="WARNING", help="vtensor's log level (INFO: the decisions)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(format="#   %(name)s: %(message)s")
    logging.getLogger("vtensor").setLevel(args.log_level)
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_step needs a CUDA device (or --device cpu)")
    gpu = None
    if DEVICE.type == "cuda":
        # Bit-identity needs deterministic kernels: cuDNN's and cuBLAS's defaults sum in an
        # order that varies from run to run (atomics, autotuned algorithms).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        gpu = torch.cuda.get_device_name()
    env = environment(cuda=DEVICE.type == "cuda", gpu=gpu)
    print(describe(env), f"on {gpu or 'cpu'}", flush=True)
    loads = workloads(quick=False, batch_scale=args.batch_scale)
    rows: list[dict[str, Any]] = []
    for name in args.models:
        model_rows = run_model(loads[name], args)
        _print(model_rows)
        rows += model_rows
        write_json_lines(args.out, env, tagged("gpu_step", rows))  # after each model: kept if cut
    print("# done", flush=True)


if __name__ == "__main__":
    main()
