"""A never-binding manager's step as a user runs it: one model in its own process, glibc's malloc.

``unbound_cost`` lets three copies take turns in one process, which also mixes their memory in
one heap. Here each variant is a fresh process training the main job's MLP (4 x 1,024 units,
batch 64, SGD with momentum) alone, with nothing preloaded and no ``MALLOC_*`` setting:
unmanaged; under a manager at 1 TiB whose plan replays lean (NOTE [lean replay]); the same
checking every hook. Per variant: the median step (forward, backward, update) after 10 warm-up
steps and the minor page faults per step (``getrusage``), where a step's tensors come back from
the kernel instead of the allocator (NOTE [passed storages seen again] in
``vtensor/activations/replay/lean.py``). Run from the repository root::

    python -m benchmarks.heap_faults --repeats 3
"""

import argparse
import os
import statistics
import subprocess
import sys

from benchmarks.common import add_out, add_quick, describe, environment, tagged, write_json_lines

VARIANTS = ("unmanaged", "lean", "checking every hook")

_RUN = """
import resource, sys, time, torch, vtensor
from torch import nn
from vtensor.tools.workload import load_builder
torch.set_num_threads(1)
model = load_builder("mlp", (64, 1, 28, 28), None)()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
variant, steps = sys.argv[1], int(sys.argv[2])
mm = None if variant == "unmanaged" else vtensor.MemoryManager(
    "1TiB", offload_params=False, check_every_hook=variant != "lean")
times = []
for step in range(10 + steps):
    if step == 10:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    began = time.perf_counter()
    if mm is None:
        nn.functional.cross_entropy(model(x), y).backward()
    else:
        with mm.step(model, opt, inputs=(x, y)):
            nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - began)
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps
print(sorted(times[10:])[steps // 2], faults)
"""


def run_variant(variant: str, steps: int) -> tuple[float, float]:
    """(median step s, page faults per step) of ``variant`` in a fresh process."""
    dropped = ("MALLOC_", "MIMALLOC_", "LD_PRELOAD")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    done = subprocess.run(
        [sys.executable, "-c", _RUN, variant, str(steps)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    step_s, faults = done.stdout.split()[-2:]
    return float(step_s), float(faults)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per variant, in turn")
    p.add_argument("--steps", type=int, default=50, help="timed steps per process")
    add_quick(p, "1 repeat of 5 steps")
    add_out(p)
    args = p.parse_args(argv)
    repeats, steps = (1, 5) if args.quick else (args.repeats, args.steps)
    env = environment(script="heap_faults", repeats=repeats, steps=steps)
    print(describe(env), flush=True)
    results: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    for _ in range(repeats):
        for variant in VARIANTS:
            results[variant].append(run_variant(variant, steps))
    plain = statistics.median(s for s, _ in results["unmanaged"])
    rows = []
    print("| variant | step ms (median of processes) | ÷ unmanaged | page faults a step |")
    print("|---|---|---|---|")
    for variant, runs in results.items():
        step_s = statistics.median(s for s, _ in runs)
        faults = statistics.median(f for _, f in runs)
        rows.append(
            {"variant": variant, "step_s": step_s, "ratio": step_s / plain, "faults": faults}
        )
        print(f"| {variant} | {1e3 * step_s:.1f} | {step_s / plain:.3f}x | {faults:.0f} |")
    write_json_lines(args.out, env, tagged("variant", rows))


if __name__ == "__main__":
    main()
