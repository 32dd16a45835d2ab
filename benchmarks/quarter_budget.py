"""Training at a quarter of the unmanaged peak: activations and parameters both off the device.

At 25 % of its unmanaged training peak a model's parameters, gradients and optimizer state
alone may not fit beside the activations a step needs. This script trains each benchmark
workload (``benchmarks/zoo/workloads.py``) with ``vtensor.ParamOffload`` (parameters, gradients, SGD
momentum in the swap tier) inside a ``vtensor.MemoryManager`` whose budget is the fraction of
the unmanaged peak, and checks the weights against unmanaged training bit for bit.

On CPU the manager's tracked bytes count every heap allocation of the step, the parameters that
ParamOffload brings back included, so its budget is the budget of the whole step.

Run from the repository root::

    python -m benchmarks.quarter_budget --models resnet mobilenet gpt --fraction 0.25
"""

import argparse
import copy
import statistics
import time
from typing import Any

import torch
from torch import nn

import vtensor
from benchmarks.common import add_out, describe, environment, tagged, write_json_lines
from benchmarks.zoo import Workload, workloads


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def unmanaged(w: Workload, model: nn.Module, steps: int) -> tuple[int, list[float]]:
    """Train ``steps`` steps under an unlimited budget: the tracked peak and step times.

    The peak is the highest of every iteration's: the later ones replay lean, read at module
    boundaries only (``IterationReport.lean``), and would understate it.
    """
    optimizer, times, peak = _sgd(model), [], 0
    with vtensor.MemoryManager(1 << 40) as mm:
        for i in range(steps):
            x, y = w.batch(i)
            begin = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            with mm.step(model, optimizer, (x, y)):
                w.loss(model, x, y).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            times.append(time.perf_counter() - begin)
            peak = max(peak, mm.report().peak_device_bytes)
        return peak, times


def offloaded(
    w: Workload,
    model: nn.Module,
    steps: int,
    budget: int,
    param_budget: int,
    count_workspaces: bool,
    recompute: bool,
) -> dict[str, float]:
    """Train under both managers; the worst peaks, bytes moved per step and step times."""
    optimizer, times = _sgd(model), []
    peak = independent = first_independent = out = 0.0
    with (
        vtensor.ParamOffload(model, optimizer, param_budget) as po,
        vtensor.MemoryManager(
            budget,
            count_workspaces=count_workspaces,
            measure_peaks=True,
            recompute=recompute,
            encode_masks="auto" if recompute else False,
        ) as mm,
    ):
        for i in range(steps):
            x, y = w.batch(i)
            begin = time.perf_counter()
            with mm.step(model, None, (x, y)):
                w.loss(model, x, y).backward()  # type: ignore[no-untyped-call]
            po.step()
            times.append(time.perf_counter() - begin)
            rep = mm.report()
            peak, out = max(peak, rep.peak_device_bytes), rep.bytes_out
            # The first iteration learns the workspaces as it meets them (count_workspaces):
            # it is reported apart.
            if i == 0:
                first_independent = rep.peak_independent_bytes or 0
            else:
                independent = max(independent, rep.peak_independent_bytes or 0)
        params = po.report()
    return {
        "peak": peak,
        "independent": independent,
        "first_independent": first_independent,
        "param_peak": params.peak_resident_bytes,
        "out": out + params.bytes_out / params.steps,
        "step_s": statistics.median(times[1:]),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["resnet", "mobilenet", "gpt"])
    p.add_argument("--fraction", type=float, default=0.25, help="budget / unmanaged peak")
    p.add_argument(
        "--param-fraction", type=float, default=0.07, help="ParamOffload budget / unmanaged peak"
    )
    p.add_argument("--steps", type=int, default=6)
    p.add_argument(
        "--count-workspaces",
        action="store_true",
        help="budget the workspaces operators allocate internally too (RSS within the budget)",
    )
    p.add_argument(
        "--recompute",
        action="store_true",
        help="let the manager recompute activations too (the hybrid, with mask encoding)",
    )
    add_out(p)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    env = environment()
    print(describe(env))
    rows: list[dict[str, Any]] = []
    print(
        "| model | unmanaged peak MiB | budget MiB | tracked peak MiB "
        "| independent peak MiB (first iteration) "
        "| parameter-state peak MiB | MiB out per step | step s (unmanaged) | weights |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        w = workloads(quick=False)[name]
        torch.manual_seed(0)
        base = w.build()
        reference = copy.deepcopy(base)
        p0, plain_times = unmanaged(w, reference, args.steps)
        model = copy.deepcopy(base)
        budget, param_budget = int(args.fraction * p0), int(args.param_fraction * p0)
        mib = 2**20
        row: dict[str, Any] = {
            "model": name,
            "model_description": w.describe,
            "unmanaged_peak_bytes": p0,
            "budget_bytes": budget,
            "param_budget_bytes": param_budget,
            "count_workspaces": args.count_workspaces,
            "recompute": args.recompute,
            "unmanaged_step_s": statistics.median(plain_times[1:]),
        }
        rows.append(row)
        try:
            r = offloaded(
                w, model, args.steps, budget, param_budget, args.count_workspaces, args.recompute
            )
        except vtensor.InfeasibleBudgetError as exc:
            share = exc.min_budget_bytes / p0
            row.update(min_budget_bytes=exc.min_budget_bytes, infeasible_at=str(exc.step))
            print(
                f"| {name} | {p0 / mib:.1f} | {budget / mib:.1f} | infeasible: needs "
                f"{exc.min_budget_bytes / mib:.1f} MiB ({share:.1%}) at {exc.step} |"
            )
            continue
        expected = reference.state_dict()
        same = all(torch.equal(t, expected[k]) for k, t in model.state_dict().items())
        row.update(
            tracked_peak_bytes=r["peak"],
            independent_peak_bytes=r["independent"],
            first_independent_peak_bytes=r["first_independent"],
            param_peak_bytes=r["param_peak"],
            bytes_out_per_step=r["out"],
            step_s=r["step_s"],
            bit_identical=same,
        )
        print(
            f"| {name} | {p0 / mib:.1f} | {budget / mib:.1f} | {r['peak'] / mib:.1f} "
            f"| {r['independent'] / mib:.1f} ({r['first_independent'] / mib:.1f}) "
            f"| {r['param_peak'] / mib:.1f} | {r['out'] / mib:.0f} "
            f"| {r['step_s']:.2f} ({statistics.median(plain_times[1:]):.2f}) "
            f"| {'bit-identical' if same else 'DIFFERENT'} |"
        )
    write_json_lines(args.out, env, tagged("model", rows))


if __name__ == "__main__":
    main()
