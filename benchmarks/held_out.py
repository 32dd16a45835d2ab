"""Models no test uses, at a fraction of their peak: the hybrid manager against checkpointing.

Nine small models built for this benchmark and used by no test (``benchmarks/held_out_models.py``:
a DenseNet, squeeze-and-excitation gating, a ConvNeXt, a ViT with ``nn.MultiheadAttention``, a
GRU language model, a U-Net, a ResNet of basic blocks, a transformer of
``nn.TransformerEncoderLayer`` and an MLP-Mixer), each with a pattern the test zoo lacks.
Per model, in one process and in turns step by step from the same weights:
unmanaged; ``MemoryManager(budget, recompute=True, encode_masks="auto",
offload_params=False)`` at the fraction of the model's peak (parameters stay, as they do under
checkpointing) (tracked bytes, measured by a manager whose budget never binds); and
``torch.utils.checkpoint`` (non-reentrant) on every block, one line of code a user would write
instead. Per model: the budget, the managed iteration's highest tracked peak against it,
whether every gradient is bit-identical to the unmanaged one, the median managed step over the
steps that replayed a plan (the profiled iterations of its decision left out) against the unmanaged
median over the same steps, checkpointing's the same way with its tracked peak against the
budget (a checkpointed copy under a budget that never binds), and the modules recomputed and
MiB moved by the last managed step. A budget below the model's floor is reported with the
minimum the manager states, beside checkpointing's peak against the budget. The process keeps
glibc's default allocator settings, as a user's would. Run from the repository root::

    python -m benchmarks.held_out --out held_out.jsonl
    python -m benchmarks.held_out --quick    # CI-sized; its rows are not results
"""

import argparse
import copy
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import vtensor
from benchmarks.common import (
    add_out,
    add_quick,
    describe,
    environment,
    tagged,
    write_json_lines,
)
from benchmarks.held_out_models import MODELS

MIB = 1 << 20


def _batch(name: str, step: int, batch: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    if name == "gru":
        x = torch.randint(0, 64, (batch, size), generator=g)
        return x, torch.randint(0, 64, (batch, size), generator=g)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(
        0, 10, (batch,), generator=g
    )


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _checkpointed_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss with every block under ``torch.utils.checkpoint``, as a user would wrap them."""
    blocks = list(model.blocks)  # type: ignore[arg-type]
    for block in blocks:
        forward = block.forward

        def wrapped(*args: Any, forward: Callable[..., Any] = forward) -> Any:
            # A list argument is copied: checkpointing would see the caller's later appends.
            copied = [list(a) if isinstance(a, list) else a for a in args]
            return checkpoint(forward, *copied, use_reentrant=False)

        block.forward = wrapped  # type: ignore[method-assign]
    try:
        return _loss(model, x, y)
    finally:
        for block in blocks:
            del block.forward


def _peak(name: str, model: nn.Module, batch: int, size: int, checkpointed: bool = False) -> int:
    """The tracked peak of two steps of a copy of ``model``, under a budget that never binds."""
    probe = copy.deepcopy(model)
    opt = torch.optim.SGD(probe.parameters(), lr=0.01, momentum=0.9)
    loss = _checkpointed_loss if checkpointed else _loss
    with vtensor.MemoryManager("1TiB", storage_dir=tempfile.mkdtemp()) as mm:
        for step in range(2):
            x, y = _batch(name, step, batch, size)
            with mm.step(probe, opt, (x, y)):
                loss(probe, x, y).backward()
            opt.step()
            opt.zero_grad()
        return max(r.peak_device_bytes for r in mm.reports)


def run_model(name: str, steps: int, fraction: float, batch: int, size: int) -> dict[str, Any]:
    """One model: unmanaged, managed and checkpointed, in turns step by step."""
    torch.manual_seed(0)
    ref = MODELS[name]()
    managed, checkpointed = copy.deepcopy(ref), copy.deepcopy(ref)
    models = (ref, managed, checkpointed)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in models]
    peak = _peak(name, ref, batch, size)
    budget = int(fraction * peak)
    row: dict[str, Any] = {"model": name, "peak_bytes": peak, "budget_bytes": budget}
    times: dict[str, list[float]] = {"unmanaged": [], "managed": [], "checkpoint": []}
    identical, worst = True, 0
    mm = vtensor.MemoryManager(
        budget,
        storage_dir=tempfile.mkdtemp(),
        recompute=True,
        encode_masks="auto",
        offload_params=False,
    )
    try:
        for step in range(steps):
            x, y = _batch(name, step, batch, size)
            for variant, model in zip(times, models, strict=True):
                torch.manual_seed(100 + step)  # dropout and stochastic depth alike
                begin = time.perf_counter()
                if variant == "managed":
                    with mm.step(model, opts[1], (x, y)):
                        _loss(model, x, y).backward()
                elif variant == "checkpoint":
                    _checkpointed_loss(model, x, y).backward()
                else:
                    _loss(model, x, y).backward()
                times[variant].append(time.perf_counter() - begin)
            worst = max(worst, mm.report().peak_device_bytes)
            identical &= all(
                torch.equal(a.grad, b.grad)
                for a, b in zip(ref.parameters(), managed.parameters(), strict=True)
                if a.grad is not None
            )
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
    except vtensor.InfeasibleBudgetError as err:
        row["min_budget_bytes"] = err.min_budget_bytes
        # Whether the user's one line would have fitted where the manager states it cannot.
        row["checkpoint_peak_bytes"] = _peak(name, ref, batch, size, checkpointed=True)
        return row
    finally:
        mm.close()
    last = mm.reports[-1]
    # Steady steps only: the profiled iterations are the decision's, not the plan's.
    steady = [i for i, r in enumerate(mm.reports) if r.plan_source.value in ("planned", "cached")]
    if not steady:
        row["error"] = "no steady step: raise --steps"
        return row
    medians = {v: statistics.median(t[i] for i in steady) for v, t in times.items()}
    row.update(
        steady_steps=len(steady),
        checkpoint_peak_bytes=_peak(name, ref, batch, size, checkpointed=True),
        worst_peak_bytes=worst,
        grads_identical=identical,
        managed_vs_unmanaged=medians["managed"] / medians["unmanaged"],
        checkpoint_vs_unmanaged=medians["checkpoint"] / medians["unmanaged"],
        unmanaged_step_s=medians["unmanaged"],
        recomputed_modules=len(last.recomputed),
        mib_out_last_step=last.bytes_out / MIB,
        plan_sources=[r.plan_source.value for r in mm.reports],
    )
    return row


def _table(rows: list[dict[str, Any]], fraction: float) -> str:
    lines = [
        f"| model | peak MiB | budget MiB ({fraction:.0%}) | managed peak / budget | grads "
        "identical | managed step | checkpoint peak / budget | checkpoint step | steady steps "
        "| modules recomputed | MiB out |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['model']} | {r['peak_bytes'] / MIB:.1f} | {r['budget_bytes'] / MIB:.1f} |"
        if "min_budget_bytes" in r:
            lines.append(
                f"{head} infeasible: minimum {r['min_budget_bytes'] / MIB:.1f} MiB "
                f"({r['min_budget_bytes'] / r['peak_bytes']:.0%} of the peak) | - | - | "
                f"{r['checkpoint_peak_bytes'] / r['budget_bytes']:.2f} | - | - | - | - |"
            )
            continue
        if "error" in r:
            lines.append(f"{head} {r['error']} |")
            continue
        lines.append(
            f"{head} {r['worst_peak_bytes'] / r['budget_bytes']:.2f} | "
            f"{'yes' if r['grads_identical'] else 'NO'} | {r['managed_vs_unmanaged']:.2f}x | "
            f"{r['checkpoint_peak_bytes'] / r['budget_bytes']:.2f} | "
            f"{r['checkpoint_vs_unmanaged']:.2f}x | {r['steady_steps']} | "
            f"{r['recomputed_modules']} | {r['mib_out_last_step']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run each model, print the table, write the JSON lines."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_quick(p, "two models, 16 steps, batch 4")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--steps", type=int, default=45, help="steps per model (default 45)")
    p.add_argument("--fraction", type=float, default=0.5, help="budget / peak (default 0.5)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    add_out(p)
    args = p.parse_args(argv)
    batch, size = (4, 64) if args.quick else (16, 64)
    if args.quick:
        args.models, args.steps = ["senet", "vit"], 16
    torch.set_num_threads(args.threads)
    env = environment(script="held_out", steps=args.steps, fraction=args.fraction)
    print(describe(env), flush=True)
    rows = []
    for name in args.models:
        rows.append(run_model(name, args.steps, args.fraction, batch, size))
        print(f"# {name} done", flush=True)
    print(_table(rows, args.fraction))
    if args.out:
        write_json_lines(args.out, env, tagged("held_out", rows))


if __name__ == "__main__":
    main()
