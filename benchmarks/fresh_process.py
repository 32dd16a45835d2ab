"""Iteration 0 of a fresh process against its steady iterations: tracked peak, one-time bytes.

Every run is a new interpreter (a deployed SuperNode starts one per round). Per model and
thread count, four managed iterations at a 1 TiB budget (nothing moves) give the tracked peak
of each iteration and the process memory it kept for good (``one_time_bytes``: MKL's GEMM
buffer pool, left out of the tracked bytes, NOTE [MKL buffer pool] in
``vtensor/measure/trackers.py``); ``peak + one-time`` is what iteration 0 would count if the
pool were not left out. Then a fresh process at a third of the steady minimum is refused, and
a fresh process at the minimum it states trains all four iterations, or not.

Run from the repository root::

    python -m benchmarks.fresh_process                 # mlp and cnn, 1 and 2 threads
    python -m benchmarks.fresh_process --quick         # mlp, 2 threads
    python -m benchmarks.fresh_process --out fresh.jsonl
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from benchmarks.common import (
    add_out,
    add_quick,
    describe,
    environment,
    reexec_with_honest_rss,
    tagged,
    write_json_lines,
)
from vtensor import format_bytes

STEPS = 4

_CHILD = r"""
import json, sys
import torch
from torch import nn
import vtensor

model_name, threads, budget, steps, storage = sys.argv[1:6]
torch.set_num_threads(int(threads))
torch.manual_seed(0)
if model_name == "mlp":  # six 256-wide layers, batch 512
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)], nn.Linear(256, 10)
    )
    x = torch.randn(512, 256)
else:  # an MNIST-sized CNN: two 3x3 convolutions, batch 32
    model = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 14 * 14, 10),
    )
    x = torch.randn(32, 1, 28, 28)
y = torch.randint(0, 10, (x.shape[0],))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
rows, error, minimum = [], None, None
try:
    with vtensor.MemoryManager(int(budget), storage_dir=storage, offload_params=False) as mm:
        for _ in range(int(steps)):
            optimizer.zero_grad()
            with mm.step(model, optimizer, inputs=(x, y)):
                nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            r = mm.report()
            rows.append([r.peak_device_bytes, r.min_budget_bytes, r.one_time_bytes])
except vtensor.InfeasibleBudgetError as err:
    error, minimum = str(err), err.min_budget_bytes
print(json.dumps({"rows": rows, "error": error, "minimum": minimum}))
"""


def _child(model: str, threads: int, budget_bytes: int, storage: str) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    argv = [sys.executable, "-c", _CHILD, model, str(threads), str(budget_bytes), str(STEPS)]
    done = subprocess.run(
        [*argv, storage], capture_output=True, text=True, timeout=600, env=env, check=True
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(model: str, threads: int) -> dict[str, Any]:
    """The fresh-process figures of ``model`` with ``threads`` threads."""
    with tempfile.TemporaryDirectory(prefix="vtensor-fresh-") as storage:
        probe = _child(model, threads, 2**40, storage)
        rows = probe["rows"]
        steady_minimum = max(row[1] for row in rows[1:])
        refused = _child(model, threads, steady_minimum // 3, storage)
        stated = refused["minimum"]
        retried = _child(model, threads, stated, storage) if stated else None
    return {
        "model": model,
        "threads": threads,
        "peaks": [row[0] for row in rows],
        "one_time_bytes": [row[2] for row in rows],
        "steady_minimum": steady_minimum,
        "stated_minimum": stated,
        "retry_trained": retried is not None and retried["error"] is None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick(parser, "mlp with 2 threads only")
    add_out(parser)
    args = parser.parse_args()
    reexec_with_honest_rss()
    env = environment()
    print(describe(env))
    cases = [("mlp", 2)] if args.quick else [(m, t) for m in ("mlp", "cnn") for t in (1, 2)]
    results = [measure(model, threads) for model, threads in cases]
    print(
        "| model | threads | iteration 0 peak | + one-time | steady peak | steady minimum "
        "| stated at a third | retry at it |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['model']} | {r['threads']} | {format_bytes(r['peaks'][0])} "
            f"| {format_bytes(r['peaks'][0] + r['one_time_bytes'][0])} "
            f"| {format_bytes(r['peaks'][-1])} | {format_bytes(r['steady_minimum'])} "
            f"| {format_bytes(r['stated_minimum'] or 0)} "
            f"| {'trains' if r['retry_trained'] else 'refused'} |"
        )
    write_json_lines(args.out, env, tagged("fresh_process", results))


if __name__ == "__main__":
    main()
