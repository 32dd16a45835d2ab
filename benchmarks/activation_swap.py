"""Activation swapping under a memory budget: vtensor (whole-tensor and chunked) vs checkpointing.

Trains a MobileNetV2-class CNN (inverted residuals, x6 expansion, BatchNorm, ReLU6) at 128 px on
CPU and measures, per variant and budget:

- tracked peak: the manager's own figure (glibc ``mallinfo2`` heap growth sampled at every hook
  point, plus the baseline of parameters, gradients, optimizer state and inputs);
- independent peaks: a ``LiveStorageTracker`` dispatch mode (distinct live storages) on one extra
  step per variant, and the manager's RSS figure (baseline + VmHWM growth over the step);
- bytes swapped out/in per step, stall time, and the median step time over round-robin rounds;
- whether the gradients are bit-identical to the unmanaged run.

Budgets are fractions of the unmanaged tracked peak. ``torch.utils.checkpoint`` takes no budget: it
is run once and reported as is.

Usage::

    python benchmarks/activation_swap.py                 # full run (a few minutes on 2 cores)
    python benchmarks/activation_swap.py --quick         # CI-sized
    python benchmarks/activation_swap.py --out results.json

The script re-executes itself with ``MALLOC_MMAP_THRESHOLD_=65536`` when that variable is unset,
so that RSS follows the live bytes (see NOTE [honest RSS] in ``vtensor/accounting.py``).
"""

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
MMAP_VALUE = "65536"

if os.environ.get(MMAP_ENV) != MMAP_VALUE and __name__ == "__main__":
    # glibc reads the variable at start-up only: re-execute before torch allocates anything.
    os.environ[MMAP_ENV] = MMAP_VALUE
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import vtensor  # noqa: E402
from vtensor.accounting import LiveStorageTracker  # noqa: E402

MIB = 1 << 20
HUGE_BUDGET = 1 << 40


# -- model ----------------------------------------------------------------------------------------
# edgefl.models.mobilenet.MobileNetV2Small exists but uses GroupNorm and strides reduced for
# 28-32 px inputs; this benchmark wants the ImageNet layout (BatchNorm, standard strides) at 128 px.
_SETTINGS = (  # (expansion t, channels c, repeats n, first stride s): MobileNetV2, ImageNet strides
    (1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
    (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1),
)


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1,
             act: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    ]
    if act:
        layers.append(nn.ReLU6())
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """1x1 expand -> 3x3 depthwise -> 1x1 linear projection, with a skip when shapes allow."""

    def __init__(self, cin: int, cout: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = cin * expansion
        layers: list[nn.Module] = [] if expansion == 1 else [_conv_bn(cin, hidden, 1)]
        layers += [_conv_bn(hidden, hidden, 3, stride, groups=hidden),
                   _conv_bn(hidden, cout, 1, act=False)]
        self.body = nn.Sequential(*layers)
        self.skip = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return x + out if self.skip else out  # type: ignore[no-any-return]


class MobileNetV2(nn.Module):
    """MobileNetV2 (Sandler et al. 2018) with optional per-block activation checkpointing."""

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0) -> None:
        super().__init__()
        cin = max(8, int(32 * width_mult))
        self.stem = _conv_bn(3, cin, 3, stride=2)
        blocks: list[nn.Module] = []
        for t, c, n, s in _SETTINGS:
            cout = max(8, int(c * width_mult))
            for i in range(n):
                blocks.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        self.blocks = nn.ModuleList(blocks)
        self.last = _conv_bn(cin, 1280, 1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(1280, num_classes))
        self.checkpoint_blocks = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint_blocks else block(x)
        return self.head(self.last(x))  # type: ignore[no-any-return]


# -- variants -------------------------------------------------------------------------------------
@dataclass
class Variant:
    """One configuration being timed: its own model copy, optimizer and (maybe) manager."""

    name: str
    budget_frac: float | None
    model: nn.Module
    optimizer: torch.optim.Optimizer
    manager: vtensor.MemoryManager | None = None
    error: str | None = None
    min_budget_bytes: int | None = None
    step_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    reports: list[vtensor.IterationReport] = field(default_factory=list)
    grads_identical: bool | None = None
    grad_max_abs_diff: float | None = None
    dispatch_peak: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def _run_step(v: Variant, x: torch.Tensor, y: torch.Tensor) -> None:
    """One training iteration of ``v`` (forward, backward; the optimizer step is separate)."""
    v.optimizer.zero_grad(set_to_none=True)
    if v.manager is None:
        _loss(v.model, x, y).backward()
        return
    with v.manager.step(v.model, v.optimizer, inputs=(x, y)):
        _loss(v.model, x, y).backward()


def _state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    for state in opt.state.values():
        tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
    return tensors


def _dispatch_peak(v: Variant, x: torch.Tensor, y: torch.Tensor) -> int:
    """Peak of distinct live CPU storages over one step of ``v`` (LiveStorageTracker)."""
    v.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    tracker = LiveStorageTracker("cpu")
    tracker.track(*_state_tensors(v.model, v.optimizer), x, y)
    with tracker:
        tracker.reset_peak()
        _run_step(v, x, y)
    return tracker.peak_bytes


def _compare_grads(model: nn.Module, ref: list[torch.Tensor | None]) -> tuple[bool, float]:
    same, worst = True, 0.0
    for p, r in zip(model.parameters(), ref, strict=True):
        if p.grad is None or r is None:
            same &= p.grad is None and r is None
            continue
        if not torch.equal(p.grad, r):
            same = False
            worst = max(worst, (p.grad - r).abs().max().item())
    return same, worst


def _batch(round_index: int, batch: int, image: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + round_index)
    x = torch.randn(batch, 3, image, image, generator=gen)
    y = torch.randint(0, 1000, (batch,), generator=gen)
    return x, y


# -- machine --------------------------------------------------------------------------------------
def _steal_idle() -> dict[str, int]:
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return {n: int(v) for n, v in zip(names, fields, strict=False)}


def _machine(threads: int) -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": threads,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.is_available(),
        MMAP_ENV: os.environ.get(MMAP_ENV),
    }


# -- the benchmark --------------------------------------------------------------------------------
def _measure_reference(base: nn.Module, make_opt: Callable[[nn.Module], torch.optim.Optimizer],
                       x: torch.Tensor, y: torch.Tensor, ckpt: bool,
                       storage_dir: str) -> dict[str, int]:
    """Tracked and RSS peak under a never-binding manager, and the dispatch-mode peak unmanaged."""
    model = copy.deepcopy(base)
    model.checkpoint_blocks = ckpt
    opt = make_opt(model)
    probe = Variant("probe", None, model, opt)
    _run_step(probe, x, y)  # warm-up: one-time allocations (oneDNN caches, optimizer state)
    opt.step()
    dispatch = _dispatch_peak(probe, x, y)
    probe.manager = vtensor.MemoryManager(HUGE_BUDGET, storage_dir=storage_dir)
    tracked, rss = 0, 0
    try:
        for _ in range(2):
            _run_step(probe, x, y)
            rep = probe.manager.report()
            tracked = max(tracked, rep.peak_device_bytes)
            rss = max(rss, rep.peak_independent_bytes)
    finally:
        probe.manager.close()
    return {"tracked": tracked, "rss": rss, "dispatch": dispatch}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    machine = _machine(args.threads)
    load_before = os.getloadavg()
    stat_before = _steal_idle()
    started = time.perf_counter()
    print(f"# activation_swap: torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"torch.set_num_threads({args.threads}), {MMAP_ENV}={os.environ.get(MMAP_ENV)}, "
          f"load average {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}")
    print(f"# MobileNetV2 width {args.width}, {args.image} px, batch {args.batch}, "
          f"{args.steps} timed rounds after 1 warm-up round, variants interleaved round-robin")

    base = MobileNetV2(width_mult=args.width)
    def make_opt(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)

    storage_dir = args.storage_dir or tempfile.gettempdir()
    x0, y0 = _batch(0, args.batch, args.image)

    ref = _measure_reference(base, make_opt, x0, y0, False, storage_dir)
    ref_ckpt = _measure_reference(base, make_opt, x0, y0, True, storage_dir)
    p0 = ref["tracked"]
    print(f"# unmanaged peak: tracked {p0 / MIB:.1f} MiB, "
          f"dispatch {ref['dispatch'] / MIB:.1f} MiB, RSS {ref['rss'] / MIB:.1f} MiB")

    def new_variant(name: str, frac: float | None, granularity: str | None,
                    ckpt: bool = False) -> Variant:
        model = copy.deepcopy(base)
        model.checkpoint_blocks = ckpt
        v = Variant(name, frac, model, make_opt(model))
        if granularity is not None:
            assert frac is not None
            v.manager = vtensor.MemoryManager(int(p0 * frac), chunk_bytes=args.chunk_bytes,
                                              storage_dir=storage_dir, granularity=granularity)
        return v

    variants = [new_variant("unmanaged", None, None), new_variant("checkpoint", None, None, True)]
    for frac in args.budgets:
        variants.append(new_variant("vtensor-tensor", frac, "tensor"))
        variants.append(new_variant("vtensor-chunk", frac, "chunk"))

    # Round 0 is the warm-up (and the gradient check); rounds 1..steps are timed.
    for r in range(args.steps + 1):
        x, y = _batch(r, args.batch, args.image)
        ref_grads: list[torch.Tensor | None] = []
        for v in variants:
            if v.error is not None:
                continue
            gc.collect()
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                _run_step(v, x, y)
            except vtensor.InfeasibleBudgetError as exc:
                v.error = f"InfeasibleBudgetError: {exc}"
                v.min_budget_bytes = exc.min_budget_bytes
                if v.manager is not None and v.manager.reports:
                    v.reports.append(v.manager.report())
                print(f"# {v.name} at {v.budget_frac:.0%}: infeasible "
                      f"(min budget {exc.min_budget_bytes / MIB:.1f} MiB)")
                continue
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if v.name == "unmanaged":
                ref_grads = [None if p.grad is None else p.grad.clone()
                             for p in v.model.parameters()]
            elif r == 0:
                v.grads_identical, v.grad_max_abs_diff = _compare_grads(v.model, ref_grads)
            v.optimizer.step()
            if v.manager is not None:
                v.reports.append(v.manager.report())
            if r > 0:
                v.step_s.append(dt)
                v.cpu_s.append(dc)
        print(f"# round {r} done at {time.perf_counter() - started:.0f} s")

    # One extra, untimed step per variant under the dispatch-mode tracker (costly per op).
    xm, ym = _batch(args.steps + 1, args.batch, args.image)
    for v in variants:
        if v.error is not None:
            continue
        if v.manager is None:
            v.dispatch_peak = ref_ckpt["dispatch"] if v.name == "checkpoint" else ref["dispatch"]
            continue
        try:
            v.dispatch_peak = _dispatch_peak(v, xm, ym)
            rep = v.manager.report()
            v.extra["dispatch_step_tracked_peak"] = rep.peak_device_bytes
        except vtensor.InfeasibleBudgetError as exc:
            v.extra["dispatch_step_error"] = str(exc)
    for v in variants:
        if v.manager is not None:
            v.manager.close()

    load_after = os.getloadavg()
    stat_after = _steal_idle()
    ticks = {k: stat_after[k] - stat_before[k] for k in stat_before}
    total_ticks = max(1, sum(ticks.values()))
    machine.update({
        "load_avg_before": load_before, "load_avg_after": load_after,
        "steal_frac": ticks.get("steal", 0) / total_ticks,
        "idle_frac": ticks.get("idle", 0) / total_ticks,
        "wall_s_total": time.perf_counter() - started,
    })
    unmanaged_median = statistics.median(variants[0].step_s)
    rows = [_row(v, p0, ref, ref_ckpt, args, machine, unmanaged_median) for v in variants]
    return rows


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _row(v: Variant, p0: int, ref: dict[str, int], ref_ckpt: dict[str, int],
         args: argparse.Namespace, machine: dict[str, Any],
         unmanaged_median: float) -> dict[str, Any]:
    budget = None if v.manager is None else v.manager.budget_bytes
    timed = v.reports[1:] if len(v.reports) > 1 else v.reports
    if v.manager is None:
        r = ref_ckpt if v.name == "checkpoint" else ref
        tracked, rss = r["tracked"], r["rss"]
        out_b = in_b = 0
        stall = transfer = 0.0
    else:
        tracked = max((rep.peak_device_bytes for rep in v.reports), default=None)
        rss = max((rep.peak_independent_bytes for rep in v.reports), default=None)
        out_b = _median([rep.bytes_out for rep in timed]) if timed else None
        in_b = _median([rep.bytes_in for rep in timed]) if timed else None
        stall = _median([rep.stall_s for rep in timed]) if timed else None
        transfer = _median([rep.transfer_s for rep in timed]) if timed else None
    step = _median(v.step_s)
    over = None
    if budget is not None and tracked is not None:
        over = tracked - (budget + (args.chunk_bytes if v.name == "vtensor-chunk" else 0))
    return {
        "variant": v.name,
        "budget_frac": v.budget_frac,
        "budget_bytes": budget,
        "unmanaged_tracked_peak_bytes": p0,
        "tracked_peak_bytes": tracked,
        "dispatch_peak_bytes": v.dispatch_peak,
        "rss_peak_bytes": rss,
        "peak_over_budget": None if budget is None or tracked is None else tracked / budget,
        "tracked_minus_budget_plus_chunk_bytes": over,
        "bytes_out_per_step": out_b,
        "bytes_in_per_step": in_b,
        "bytes_out_all_steps": [rep.bytes_out for rep in v.reports],
        "bytes_in_all_steps": [rep.bytes_in for rep in v.reports],
        "stall_s_median": stall,
        "transfer_s_median": transfer,
        "step_s_median": step,
        "step_s_all": v.step_s,
        "cpu_s_median": _median(v.cpu_s),
        "vs_unmanaged": None if step is None else step / unmanaged_median,
        "grads_identical": True if v.name == "unmanaged" else v.grads_identical,
        "grad_max_abs_diff": v.grad_max_abs_diff,
        "error": v.error,
        "min_budget_bytes": v.min_budget_bytes,
        "extra": v.extra,
        "model": {"name": "mobilenet_v2", "width": args.width, "image": args.image,
                  "batch": args.batch, "optimizer": "SGD(lr=0.01, momentum=0.9)"},
        "chunk_bytes": args.chunk_bytes if v.name == "vtensor-chunk" else None,
        "steps_timed": len(v.step_s),
        "machine": machine,
    }


# -- output ---------------------------------------------------------------------------------------
def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:.1f}"


def _num(n: float | None, fmt: str) -> str:
    return "-" if n is None else format(n, fmt)


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| variant | budget MiB (%) | tracked peak MiB | dispatch peak MiB | RSS peak MiB "
            "| peak/budget | MiB out | MiB in | stall s | step s (median) | vs unmanaged "
            "| grads identical |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        budget = "-" if r["budget_bytes"] is None else (
            f"{r['budget_bytes'] / MIB:.1f} ({r['budget_frac']:.0%})")
        if r["error"] is not None:
            lines.append(f"| {r['variant']} | {budget} | infeasible: min budget "
                         f"{_mib(r['min_budget_bytes'])} MiB (tracked peak "
                         f"{_mib(r['tracked_peak_bytes'])}) | | | | | | | | | |")
            continue
        grads = {True: "yes", False: f"NO (max diff {_num(r['grad_max_abs_diff'], '.3g')})",
                 None: "-"}[r["grads_identical"]]
        lines.append(
            f"| {r['variant']} | {budget} | {_mib(r['tracked_peak_bytes'])} "
            f"| {_mib(r['dispatch_peak_bytes'])} | {_mib(r['rss_peak_bytes'])} "
            f"| {_num(r['peak_over_budget'], '.3f')} | {_mib(r['bytes_out_per_step'])} "
            f"| {_mib(r['bytes_in_per_step'])} | {_num(r['stall_s_median'], '.3f')} "
            f"| {_num(r['step_s_median'], '.2f')} | {_num(r['vs_unmanaged'], '.2f')} | {grads} |")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]], chunk_bytes: int) -> list[str]:
    out = []
    by = {(r["variant"], r["budget_frac"]): r for r in rows}
    for frac in sorted({r["budget_frac"] for r in rows if r["budget_frac"] is not None},
                       reverse=True):
        whole, chunk = by.get(("vtensor-tensor", frac)), by.get(("vtensor-chunk", frac))
        if whole is None or chunk is None or whole["error"] or chunk["error"]:
            out.append(f"budget {frac:.0%}: no comparison (a variant was infeasible)")
            continue
        w, c = whole["bytes_out_per_step"], chunk["bytes_out_per_step"]
        if w:
            cut = 100 * (1 - c / w)
            word = "fewer" if cut >= 0 else "MORE"
            out.append(f"budget {frac:.0%}: chunked moved {abs(cut):.1f}% {word} bytes "
                       f"than whole-tensor ({c / MIB:.1f} vs {w / MIB:.1f} MiB out per step)")
        else:
            out.append(f"budget {frac:.0%}: whole-tensor moved no bytes")
    for r in rows:
        if r["budget_bytes"] is None or r["tracked_peak_bytes"] is None:
            continue
        slack = chunk_bytes if r["variant"] == "vtensor-chunk" else 0
        if r["tracked_peak_bytes"] > r["budget_bytes"] + chunk_bytes:
            out.append(f"NOTE {r['variant']} at {r['budget_frac']:.0%}: tracked peak "
                       f"{r['tracked_peak_bytes']} B exceeds budget + 1 chunk "
                       f"({r['budget_bytes'] + chunk_bytes} B) by "
                       f"{r['tracked_peak_bytes'] - r['budget_bytes'] - chunk_bytes} B")
        elif r["tracked_peak_bytes"] > r["budget_bytes"] + slack:
            out.append(f"NOTE {r['variant']} at {r['budget_frac']:.0%}: tracked peak exceeds the "
                       f"budget by {r['tracked_peak_bytes'] - r['budget_bytes']} B (< 1 chunk)")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small CI-sized run (under a minute)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 24; quick: 8)")
    p.add_argument("--image", type=int, default=None,
                   help="image side in px (default 128; quick: 96)")
    p.add_argument("--width", type=float, default=None,
                   help="width multiplier (default 1.0; quick: 0.5)")
    p.add_argument("--steps", type=int, default=None, help="timed rounds (default 7; quick: 2)")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.8, 0.6, 0.4],
                   help="budgets as fractions of the unmanaged tracked peak")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (1 recommended on a shared host)")
    p.add_argument("--storage-dir", default=None, help="directory of the swap files")
    p.add_argument("--out", default=None, help="write the JSON rows here")
    args = p.parse_args(argv)
    defaults = ({"batch": 8, "image": 96, "width": 0.5, "steps": 2} if args.quick
                else {"batch": 24, "image": 128, "width": 1.0, "steps": 7})
    for k, val in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, val)
    rows = run(args)
    print()
    print(table(rows))
    print()
    for line in summary(rows, args.chunk_bytes):
        print(line)
    m = rows[0]["machine"]
    print(f"# load average before {m['load_avg_before'][0]:.2f}, "
          f"after {m['load_avg_after'][0]:.2f}; steal {m['steal_frac']:.1%}; "
          f"total {m['wall_s_total']:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"# wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
