"""The planner's floors of one profile, backward steps in parts and whole: swapping, recomputing.

One workload is profiled on this machine under a manager with recomputation at each budget (a
fraction of its unmanaged peak), and its trace is planned two ways: as recorded, each backward step
in parts (NOTE [backward parts] in ``vtensor/planner/memory_model.py``), and with the parts removed,
as a step-level model sees it. Per budget and way: the smallest budget the model states for swapping
alone and for every outermost unit recomputed whole (what checkpointing every block does), the
latter also without the units' working sets (NOTE [recomputation's working set] in
``vtensor/activations/runtime/recorder.py``), and how many recomputation candidates the planner
finds at the budget, where it judges them. Bytes, not times: the figures are the same on any machine
for the same batch, so the GPU benchmark's batch (``--batch-scale 4``) can be profiled here. Run
from the repository root::

    python -m benchmarks.floors --model gpt --batch-scale 0.5 --budgets 0.5 0.4
    python -m benchmarks.floors --quick    # CI-sized; its rows are not results
"""

import argparse
import dataclasses
from typing import Any

import torch

import vtensor
from benchmarks.common import add_out, add_quick, describe, environment, tagged, write_json_lines
from benchmarks.zoo.workloads import workloads
from vtensor.planner.lgm import build_lgm, min_budget
from vtensor.planner.recompute import recompute_candidates, recompute_outermost
from vtensor.planner.recomputed import with_recompute
from vtensor.planner.trace import Trace

MIB = 2**20


def without_parts(trace: Trace) -> Trace:
    """``trace`` as a profile that kept each backward step whole would have recorded it."""
    steps = tuple(dataclasses.replace(s, part_peak_bytes=()) for s in trace.steps)
    tensors = tuple(dataclasses.replace(t, last_part=-1) for t in trace.tensors)
    return dataclasses.replace(trace, steps=steps, tensors=tensors)


def without_working(trace: Trace) -> Trace:
    """``trace`` as a profile that did not note its units' working sets would have recorded it."""
    units = tuple(dataclasses.replace(u, working_bytes=0) for u in trace.units)
    return dataclasses.replace(trace, units=units)


def _floor(trace: Trace) -> int:
    return min_budget(build_lgm(trace, trace.chunk_bytes))[0]


def rows_for(trace: Trace, budget: int) -> list[dict[str, Any]]:
    """One row per way of modelling ``trace``'s backward steps."""
    blocks = recompute_outermost(trace, 1 << 62)  # every outermost unit
    rows = []
    for way, modelled in (("parts", trace), ("whole steps", without_parts(trace))):
        rows.append(
            {
                "model": way,
                "budget_mib": budget / MIB,
                "swap_floor_mib": _floor(modelled) / MIB,
                "blocks": blocks,
                "blocks_floor_mib": _floor(with_recompute(modelled, blocks)) / MIB,
                "blocks_floor_without_working_mib": _floor(
                    with_recompute(without_working(modelled), blocks)
                )
                / MIB,
                "candidates": len(recompute_candidates(modelled, budget)),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt", choices=("gpt", "mobilenet", "resnet"))
    p.add_argument("--batch-scale", type=float, default=0.5)
    p.add_argument(
        "--budgets", type=float, nargs="+", default=None, help="default 0.5 0.4; quick: 0.9"
    )
    p.add_argument("--threads", type=int, default=2)
    add_quick(p, "small models")
    add_out(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    env = environment(script="floors", model=args.model, batch_scale=args.batch_scale)
    print(describe(env), flush=True)
    w = workloads(quick=args.quick, batch_scale=args.batch_scale)[args.model]
    torch.manual_seed(0)
    model = w.build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = w.batch(0)
    opt.zero_grad()
    w.loss(model, x, y).backward()  # type: ignore[no-untyped-call]
    opt.step()  # the momentum every later step holds
    with vtensor.MemoryManager(1 << 50, policy="reactive") as probe:
        opt.zero_grad()
        with probe.step(model, opt, inputs=(x, y)):
            w.loss(model, x, y).backward()  # type: ignore[no-untyped-call]
        peak = probe.report().peak_device_bytes
    print(f"# {w.describe}: unmanaged peak {peak / MIB:.1f} MiB")
    print(
        "| budget | MiB | steps modelled | swap floor MiB | every block recomputed, floor MiB "
        "| the same without working sets | candidates at the budget |"
    )
    print("|---" * 7 + "|")
    rows = []
    for fraction in args.budgets or ([0.9] if args.quick else [0.5, 0.4]):
        budget = int(peak * fraction)
        with vtensor.MemoryManager(budget, recompute=True, offload_params=False) as mm:
            opt.zero_grad()
            with mm.step(model, opt, inputs=(x, y)):
                w.loss(model, x, y).backward()  # type: ignore[no-untyped-call]
            assert mm.trace is not None
            for row in rows_for(mm.trace, budget):
                rows.append({"fraction": fraction, **row})
                print(
                    f"| {fraction:.0%} | {row['budget_mib']:.1f} | {row['model']} "
                    f"| {row['swap_floor_mib']:.1f} | {row['blocks_floor_mib']:.1f} "
                    f"| {row['blocks_floor_without_working_mib']:.1f} | {row['candidates']} |",
                    flush=True,
                )
    write_json_lines(args.out, env, tagged("floors", rows))


if __name__ == "__main__":
    main()
