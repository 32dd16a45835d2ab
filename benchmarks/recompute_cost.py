"""What recomputing a block costs: the profile's prediction against the measured cost.

The planner prices recomputing a unit by what the profiled iteration measured of it: its forward
time and checkpointing's own cost (``whole_s``; NOTE [unit time] in
``vtensor/activations/recompute/profile/units.py``, NOTE [mechanism cost] in
``vtensor/activations/recompute/profile/cost.py``). This script checks that price against what
recomputing each block really adds to a training step. Per model (the main job's CNN from
``conf/config.yaml``, and the benchmarks' MobileNetV2 and char GPT at half batch): one
iteration is profiled under a manager whose budget never binds, with recomputation on; then,
in this one process, the model trains without a manager, unchanged and with one block at a
time recomputed through the manager's own mechanism (``recompute_modules``: torch's
checkpointing of the whole block), the variants taking turns step by step from the same
weights. Per block: predicted and measured cost in ms (measured: the median step with it
recomputed, less the median unchanged step), and the bytes it frees. The blocks are the largest
group of sibling units (the model's feature stack); a last row recomputes every block at once.
Run from the repository root::

    python -m benchmarks.recompute_cost --out recompute_cost.jsonl
    python -m benchmarks.recompute_cost --models main --repeats 30    # the main job's CNN alone
    python -m benchmarks.recompute_cost --models gpt --repeats 10    # the char GPT's blocks
    python -m benchmarks.recompute_cost --quick    # CI-sized; its rows are not results
"""

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import vtensor
from benchmarks.common import (
    add_out,
    add_quick,
    add_repeats,
    describe,
    environment,
    main_job_model,
    repeats,
    tagged,
    write_json_lines,
)
from benchmarks.zoo import workloads
from vtensor.activations.recompute.checkpointed import recompute_modules
from vtensor.activations.recompute.profile.cost import PlainHost
from vtensor.planner.recompute import inner_bytes
from vtensor.planner.recomputed import whole_s
from vtensor.planner.trace import Trace, TraceUnit

MIB = 1 << 20
COLUMNS = ("predicted_ms", "measured_ms", "frees_mib")
Batch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def _profiled(model: nn.Module, batch: Batch, loss: Loss) -> Trace:
    """The trace of one iteration profiled with recomputation on, under a budget never met."""
    with vtensor.MemoryManager(
        1 << 40, storage_dir=tempfile.mkdtemp(prefix="recompute-cost-"), recompute=True
    ) as mm:
        x, y = batch(0)
        with mm.step(model, None, (x, y)):
            loss(model, x, y).backward()  # type: ignore[no-untyped-call]
        model.zero_grad(set_to_none=True)
        if mm.trace is None:
            raise SystemExit("the manager recorded no trace")
        return mm.trace


def _blocks(trace: Trace) -> list[TraceUnit]:
    """The safe units of the largest group of siblings (the feature stack's blocks)."""
    groups: dict[str, list[TraceUnit]] = {}
    for u in trace.units:
        groups.setdefault(u.name.rpartition(".")[0], []).append(u)
    largest = max(groups.values(), key=lambda g: (len(g), -g[0].name.count(".")))
    return [u for u in largest if u.safe]


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: Loss) -> float:
    began = time.perf_counter()
    loss(model, x, y).backward()  # type: ignore[no-untyped-call]
    took = time.perf_counter() - began
    model.zero_grad(set_to_none=True)
    return took


def measure(
    describe_model: str, model: nn.Module, batch: Batch, steps: int, loss: Loss = _cross_entropy
) -> list[dict[str, Any]]:
    """Per block: predicted and measured cost of recomputing it whole (checkpointing)."""
    trace = _profiled(model, batch, loss)
    blocks = _blocks(trace)
    host = PlainHost(torch.device("cpu"))
    # (name, recomputed)
    variants: list[tuple[str, list[str]]] = [("unchanged", [])]
    variants += [(f"{u.name} whole", [u.name]) for u in blocks]
    # Every block at once: the costs summed over the stack.
    variants.append(("every block whole", [u.name for u in blocks]))
    times: dict[str, list[float]] = {v[0]: [] for v in variants}
    x, y = batch(1)
    for i in range(steps + 1):
        for name, names in variants:
            with recompute_modules(model, names, host):
                took = _step(model, x, y, loss)
            if i:  # the first round warms each variant up
                times[name].append(took)
    base = statistics.median(times["unchanged"])
    rows = []
    for u in blocks:
        row: dict[str, Any] = {
            "model": describe_model,
            "block": u.name,
            "whole_predicted_ms": whole_s(u) * 1e3,
            "whole_measured_ms": (statistics.median(times[f"{u.name} whole"]) - base) * 1e3,
            "whole_frees_mib": inner_bytes(trace, u) / MIB,
        }
        rows.append(row | {"unchanged_step_ms": base * 1e3, "steps": steps})
    rows.append(
        {
            "model": describe_model,
            "block": "every block",
            "whole_predicted_ms": sum(whole_s(u) for u in blocks) * 1e3,
            "whole_measured_ms": (statistics.median(times["every block whole"]) - base) * 1e3,
            "whole_frees_mib": sum(inner_bytes(trace, u) for u in blocks) / MIB,
            "unchanged_step_ms": base * 1e3,
            "steps": steps,
        }
    )
    return rows


def _cell(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.2f}" if key in row else "-"


def main() -> None:
    """Parse arguments, measure each model, print the table, write the JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        nargs="+",
        choices=("main", "mobilenet", "gpt"),
        default=["main", "mobilenet"],
        help="the main job's CNN, the benchmarks' MobileNetV2 and char GPT, at half batch "
        "(default: the first two)",
    )
    add_repeats(parser, "timed steps per variant", full=15, quick=2)
    add_quick(parser, "CI-sized models, two steps")
    add_out(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    env = environment(script="recompute_cost")
    print(describe(env), flush=True)
    rows = []
    for name in args.models:
        loss: Loss = _cross_entropy
        if name == "main":
            describe_model, model, batch = main_job_model()
        else:
            w = workloads(args.quick, 0.5)[name]
            describe_model, model, batch, loss = w.describe, w.build(), w.batch, w.loss
        rows += measure(describe_model, model, batch, repeats(args, 15, 2), loss)
    keys = [f"whole_{what}" for what in COLUMNS]
    print("\n| model | block | predicted ms | measured ms | frees MiB |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['block']} | " + " | ".join(_cell(r, k) for k in keys) + " |")
    write_json_lines(args.out, env, tagged("recompute_cost", rows))


if __name__ == "__main__":
    main()
