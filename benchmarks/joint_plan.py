"""One plan for activations and parameters against two managers with budgets of their own.

A GPT-style transformer (``SdpaGPT``, as in ``benchmarks/param_offload.py``) trains with AdamW
under one budget, a fraction of its parameters + gradients + AdamW state + activations, three
ways side by side in one process, step by step on the same batches:

- ``unmanaged``: plain PyTorch, the reference (everything resident);
- ``split``: ``ParamOffload`` with its own share of the budget (the training state's share of
  the total) and its lookahead prefetch, inside a ``MemoryManager`` whose budget is the whole
  (on CPU its tracker sees every byte), each planning on its own;
- ``joint``: the same two under one budget with ``mm.step(..., params=po)``: one LGM plan for
  the activations and the parameter-side tensors (NOTE [one plan] in ``vtensor/offload/joint.py``).

Per variant: median step time over the timed steps (after two warm-up steps: the first creates
AdamW's state, the second is the joint variant's profiled one), the tracked peak
(``mm.report().peak_device_bytes``: the process's heap growth on top of the tensors present at
the step's start, sampled at every hook point), bytes moved per step (activations and parameter
side), the wait on transfers, and whether the weights are bit-identical to unmanaged training.

Run from the repository root::

    python -m benchmarks.joint_plan --fraction 0.5 --out result.jsonl
"""

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch
from torch import Tensor, nn

import vtensor
from benchmarks.common import add_out, describe, environment, tagged, write_json_lines
from benchmarks.zoo import SdpaGPT, lm_loss, step_tokens
from vtensor.sizes import format_bytes

VARIANTS = ("unmanaged", "split", "joint")


def _batch(args: argparse.Namespace, step: int) -> tuple[Tensor, Tensor]:
    return step_tokens(args.vocab, args.batch, args.seq, step)


def _loss(model: nn.Module, args: argparse.Namespace, x: Tensor, y: Tensor) -> Tensor:
    return lm_loss(model(x), y)


def _build(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = SdpaGPT(args.vocab, args.dim, args.depth, args.seq)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)


def _activation_peak(args: argparse.Namespace) -> int:
    """Tracked peak of one unmanaged step minus the parameters and gradients."""
    model, _ = _build(args)
    x, y = _batch(args, 0)
    with vtensor.MemoryManager(1 << 40, policy="reactive") as probe:
        with probe.step(model, None, (x,)):
            _loss(model, args, x, y).backward()  # type: ignore[no-untyped-call]
        peak = probe.report().peak_device_bytes
    return peak - 2 * sum(p.nbytes for p in model.parameters())


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train the three variants step by step; return the measured figures."""
    torch.set_num_threads(args.threads)
    built = {v: _build(args) for v in VARIANTS}
    params = sum(p.nbytes for p in built["unmanaged"][0].parameters())
    training = 4 * params  # weights, gradients, AdamW's two moments (fp32)
    activations = _activation_peak(args)
    budget = int(args.fraction * (training + activations))
    share = int(budget * training / (training + activations))
    chunk = args.chunk_kib * 1024
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    peaks: dict[str, list[int]] = {v: [] for v in VARIANTS if v != "unmanaged"}
    moved: dict[str, list[tuple[int, int, float]]] = {v: [] for v in peaks}
    sessions: dict[str, tuple[vtensor.ParamOffload, vtensor.MemoryManager]] = {}
    infeasible: dict[str, str] = {}  # variant -> the error that stopped it
    with tempfile.TemporaryDirectory(prefix="joint-plan-") as storage:
        for variant in peaks:
            model, opt = built[variant]
            po_budget = budget if variant == "joint" else share
            try:
                po = vtensor.ParamOffload(
                    model, opt, po_budget, chunk_bytes=chunk, storage_dir=storage
                )
            except vtensor.InfeasibleBudgetError as err:
                infeasible[variant] = str(err)
                continue
            mm = vtensor.MemoryManager(budget, chunk_bytes=chunk, storage_dir=storage)
            sessions[variant] = (po, mm)
        for step in range(args.steps + 2):
            x, y = _batch(args, step)
            for variant in [v for v in VARIANTS if v not in infeasible]:
                model, opt = built[variant]
                begin = time.perf_counter()
                if variant == "unmanaged":
                    _loss(model, args, x, y).backward()  # type: ignore[no-untyped-call]
                    opt.step()
                    opt.zero_grad()
                    if step >= 2:
                        times[variant].append(time.perf_counter() - begin)
                    continue
                po, mm = sessions[variant]
                before = (po.meter.bytes_out + po.meter.bytes_in, po.meter.stall_s)
                joint = po if variant == "joint" else None
                try:
                    with mm.step(model, inputs=(x,), params=joint):
                        _loss(model, args, x, y).backward()  # type: ignore[no-untyped-call]
                except vtensor.InfeasibleBudgetError as err:
                    infeasible[variant] = str(err)
                    continue
                po.step()
                elapsed = time.perf_counter() - begin
                if step >= 2:
                    report = mm.report()
                    times[variant].append(elapsed)
                    peaks[variant].append(report.peak_device_bytes)
                    param_moved = po.meter.bytes_out + po.meter.bytes_in - before[0]
                    stall = report.stall_s + po.meter.stall_s - before[1]
                    moved[variant].append((report.bytes_out + report.bytes_in, param_moved, stall))
        plans = {v: sessions[v][1].report().plan_source for v in peaks if v not in infeasible}
        for po, mm in sessions.values():
            po.close()
            mm.close()
    reference = built["unmanaged"][0].state_dict()
    identical = {
        v: all(torch.equal(built[v][0].state_dict()[k], t) for k, t in reference.items())
        for v in peaks
        if v not in infeasible
    }
    for v in infeasible:
        for figures in (peaks, moved, times):
            figures.pop(v, None)
    return {
        "param_bytes": params,
        "training_bytes": training,
        "activation_bytes": activations,
        "budget_bytes": budget,
        "split_param_budget_bytes": share,
        "median_step_s": {v: statistics.median(t) for v, t in times.items()},
        "step_s": times,
        "max_tracked_peak_bytes": {v: max(p) for v, p in peaks.items()},
        "activation_bytes_moved_per_step": {
            v: int(statistics.median(m[0] for m in ms)) for v, ms in moved.items()
        },
        "param_bytes_moved_per_step": {
            v: int(statistics.median(m[1] for m in ms)) for v, ms in moved.items()
        },
        "median_stall_s": {v: statistics.median(m[2] for m in ms) for v, ms in moved.items()},
        "last_plan_source": plans,
        "infeasible": infeasible,
        "bit_identical": identical,
    }


def table(result: dict[str, Any]) -> str:
    """The markdown table of one run."""
    b = format_bytes
    med = result["median_step_s"]
    rows = [
        "| variant | median step (s) | vs unmanaged | tracked peak (max) | activations moved/step "
        "| parameter side moved/step | stall/step (s) | weights identical |",
        "|---|---|---|---|---|---|---|---|",
        f"| unmanaged | {med['unmanaged']:.3f} | 1.00 | {b(result['training_bytes'] + result['activation_bytes'])} (all resident) | - | - | - | - |",  # noqa: E501
    ]
    for v in ("split", "joint"):
        if v in result["infeasible"]:
            rows.append(f"| {v} | infeasible: {result['infeasible'][v]} | | | | | | |")
            continue
        rows.append(
            f"| {v} | {med[v]:.3f} | {med[v] / med['unmanaged']:.2f} | "
            f"{b(result['max_tracked_peak_bytes'][v])} | "
            f"{b(result['activation_bytes_moved_per_step'][v])} | "
            f"{b(result['param_bytes_moved_per_step'][v])} | "
            f"{result['median_stall_s'][v]:.3f} | {result['bit_identical'][v]} |"
        )
    return "\n".join(rows) + (
        f"\n\nbudget {b(result['budget_bytes'])} for {b(result['training_bytes'])} of weights, "
        f"gradients and AdamW state and {b(result['activation_bytes'])} of activations (split: "
        f"{b(result['split_param_budget_bytes'])} for the parameter side)"
    )


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run, print the table (and write JSON with ``--out``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="timed steps after two warm-up steps")
    p.add_argument("--fraction", type=float, default=0.5, help="budget / (training + activations)")
    p.add_argument("--chunk-kib", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    add_out(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    env = environment()
    print(describe(env))
    result = run(args)
    print(table(result))
    write_json_lines(args.out, env, tagged("run", [result]))


if __name__ == "__main__":
    main()
