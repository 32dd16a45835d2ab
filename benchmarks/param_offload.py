"""Benchmark: train a transformer whose parameters + gradients + Adam state are >= 3x the budget.

Two copies of one model (``SdpaGPT`` of ``benchmarks/zoo/language.py``, same seed) train side
by side in one process, step by step, on the same batches: plainly (AdamW, ``clip_grad_norm_``)
and under ``vtensor.ParamOffload`` at a budget of a third (by default) of the plain run's
parameter + gradient + optimizer-state bytes. The script prints a markdown table: median step
time of each (after one warm-up step), the exact peak of parameter, gradient and state bytes in
memory, the step's RSS rise above its start, bytes moved per step, stall, and whether the
weights after all steps are bit-identical.

RSS is honest only with ``MALLOC_MMAP_THRESHOLD_=65536`` (NOTE [honest RSS] in measure/rss.py);
the script re-executes itself with it. Both models live in the process, so the absolute RSS
holds the plain model too: the table gives each step's rise above the RSS at its start.

Run from the repository root::

    python -m benchmarks.param_offload                                  # depth 6, dim 256
    python -m benchmarks.param_offload --depth 8 --dim 384 --out po.jsonl
"""

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch
from torch import Tensor, nn

import vtensor
from benchmarks.common import (
    add_out,
    describe,
    environment,
    reexec_with_honest_rss,
    tagged,
    write_json_lines,
)
from benchmarks.zoo import SdpaGPT, lm_loss, step_tokens
from vtensor.measure.rss import RssMeter
from vtensor.sizes import format_bytes


def _loss(model: nn.Module, args: argparse.Namespace, step: int) -> Tensor:
    tokens, targets = step_tokens(args.vocab, args.batch, args.seq, step)
    return lm_loss(model(tokens), targets)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train both variants step by step; return the measured figures."""
    torch.set_num_threads(args.threads)
    models, optimizers = [], []
    for _ in range(2):
        torch.manual_seed(0)
        model = SdpaGPT(args.vocab, args.dim, args.depth, args.seq)
        models.append(model)
        optimizers.append(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False))
    params = sum(p.numel() * 4 for p in models[0].parameters())
    footprint = 4 * params  # parameters, gradients, AdamW's two moments (fp32)
    budget = int(footprint / args.ratio)
    meter = RssMeter()
    times: dict[str, list[float]] = {"unmanaged": [], "offloaded": []}
    rises: dict[str, list[int]] = {"unmanaged": [], "offloaded": []}
    with tempfile.TemporaryDirectory(prefix="param-offload-") as storage:
        po = vtensor.ParamOffload(
            models[1], optimizers[1], budget, lookahead=args.lookahead,
            max_grad_norm=args.clip, storage_dir=storage,
        )  # fmt: skip
        moved = []
        for step in range(args.steps + 1):
            for name, model, opt in zip(times, models, optimizers, strict=True):
                meter.reset_peak()
                start_rss = meter.current_rss_bytes()
                begin = time.perf_counter()
                _loss(model, args, step).backward()  # type: ignore[no-untyped-call]
                if name == "offloaded":
                    before = (po.report().bytes_out, po.report().bytes_in)
                    po.step()
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                    opt.step()
                    opt.zero_grad()
                elapsed = time.perf_counter() - begin
                if step:  # step 0 warms up (first-use allocations, optimizer state)
                    times[name].append(elapsed)
                    rises[name].append(meter.peak_rss_bytes() - start_rss)
                    if name == "offloaded":
                        report = po.report()
                        moved.append((report.bytes_out - before[0], report.bytes_in - before[1]))
        report = po.report()
        po.close()
    identical = all(
        torch.equal(a, b) for a, b in zip(*(m.state_dict().values() for m in models), strict=True)
    )
    return {
        "param_bytes": params,
        "footprint_bytes": footprint,
        "budget_bytes": budget,
        "min_budget_bytes": report.min_budget_bytes,
        "peak_resident_bytes": report.peak_resident_bytes,
        "median_step_s": {k: statistics.median(v) for k, v in times.items()},
        "step_s": times,
        "median_rss_rise_bytes": {k: int(statistics.median(v)) for k, v in rises.items()},
        "bytes_out_per_step": int(statistics.median(m[0] for m in moved)),
        "bytes_in_per_step": int(statistics.median(m[1] for m in moved)),
        "stall_s_total": report.stall_s,
        "bit_identical": identical,
    }


def table(result: dict[str, Any]) -> str:
    """The markdown table of one run."""
    med, rise = result["median_step_s"], result["median_rss_rise_bytes"]
    b = format_bytes
    rows = [
        "| variant | median step (s) | peak params+grads+state in memory | step RSS rise |",
        "|---|---|---|---|",
        f"| unmanaged | {med['unmanaged']:.3f} | {b(result['footprint_bytes'])} | "
        f"{b(rise['unmanaged'])} |",
        f"| offloaded | {med['offloaded']:.3f} | {b(result['peak_resident_bytes'])} "
        f"(budget {b(result['budget_bytes'])}, smallest {b(result['min_budget_bytes'])}) | "
        f"{b(rise['offloaded'])} |",
    ]
    return "\n".join(rows) + (
        f"\n\nfootprint {b(result['footprint_bytes'])} = "
        f"{result['footprint_bytes'] / result['budget_bytes']:.2f}x the budget; per step written "
        f"{b(result['bytes_out_per_step'])}, read {b(result['bytes_in_per_step'])}; stall "
        f"{result['stall_s_total']:.3f} s in all; weights bit-identical: {result['bit_identical']}"
    )


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run, print the table (and write JSON with ``--out``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up step")
    p.add_argument("--ratio", type=float, default=3.0, help="footprint / budget")
    p.add_argument("--lookahead", type=int, default=1)
    p.add_argument("--clip", type=float, default=1.0)
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
    reexec_with_honest_rss()
    main()
