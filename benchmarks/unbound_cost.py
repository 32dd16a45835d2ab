"""What a manager whose budget never binds adds to a short step: the manager's own cost.

The three workloads in their small sizes at small batches, so that a step is short, as on a
GPU, and the manager's per-step and per-tensor Python work shows. MobileNetV2 and ResNet-18
have every module of their full sizes (narrower), the char GPT two of its four layers; beside
them the main job's MLP at its batch, whose large tensors show what the allocator does. Three
copies of each model from the same weights train side by side in one process: one unmanaged,
one under torch's saved-tensor hooks doing nothing (the floor any manager that sees each saved
tensor starts from), one under a manager whose budget is far above its peak (its plan moves
nothing and replays lean, without module hooks: NOTE [lean replay] and NOTE [hookless replay]
in ``vtensor/activations/replay/lean.py``). After the warm-up rounds (profiling and the first
replays), they take turns, each round in another order, and every round checks that their
gradients are bit-identical. Per model: the median step (forward and backward,
``time.perf_counter``; on CUDA after waiting for the device), the median overhead and ratio,
and the median host time spent entering ``mm.step`` (the plan key, the model's state, the
hooks) and leaving it. Run from the repository root::

    python -m benchmarks.unbound_cost --rounds 60 --out unbound_cost.jsonl
    python -m benchmarks.unbound_cost --device cuda --batch-scale 4   # on a GPU
    python -m benchmarks.unbound_cost --quick    # 4 rounds: checks the script, not results
"""

import argparse
import contextlib
import copy
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import vtensor
from benchmarks.common import add_out, add_quick, describe, environment, tagged, write_json_lines
from benchmarks.zoo.workloads import Workload, workloads
from vtensor.tools.workload import load_builder

UNBOUND_BYTES = 1 << 50
_TURNS = ["unmanaged", "hooks", "unbound"]


def _main_job_mlp() -> Workload:
    """The main job's MLP (4 x 1,024 units) on MNIST-sized random images at its batch of 64."""

    def batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(index)
        return torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)

    return Workload(
        "main",
        "the main job's MLP, 4 x 1,024 units, batch 64",
        load_builder("mlp", (64, 1, 28, 28), None),
        batch,
        lambda model, x, y: F.cross_entropy(model(x), y),
    )


def _opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _now(device: torch.device) -> float:
    """``time.perf_counter()`` once the device's queued work is done (CUDA queues it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _plain(w: Workload, model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> float:
    device = batch[0].device
    opt.zero_grad(set_to_none=True)
    begin = _now(device)
    w.loss(model, *batch).backward()  # type: ignore[no-untyped-call]
    return _now(device) - begin


def _noop_hooks(w: Workload, model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> float:
    """One step under saved-tensor hooks that do nothing: what torch's hooks cost alone."""
    with torch.autograd.graph.saved_tensors_hooks(_same, _same):
        return _plain(w, model, opt, batch)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _managed(
    w: Workload,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: Any,
    mm: vtensor.MemoryManager,
) -> tuple[float, float, float]:
    """(step, entering, leaving) seconds of one managed step."""
    device = batch[0].device
    opt.zero_grad(set_to_none=True)
    begin = _now(device)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mm.step(model, opt, inputs=batch))
        entered = time.perf_counter()  # host time: what entering costs the host
        w.loss(model, *batch).backward()  # type: ignore[no-untyped-call]
        body_end = time.perf_counter()
    left = time.perf_counter()
    return _now(device) - begin, entered - begin, left - body_end


def _same_grads(a: nn.Module, b: nn.Module) -> bool:
    return all(
        (p.grad is None and q.grad is None)
        or (p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad))
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def run_model(w: Workload, rounds: int, warmup: int, device: torch.device) -> dict[str, Any]:
    """One model's rounds on ``device``; its row."""
    torch.manual_seed(0)
    plain = w.build().to(device)
    managed, hooked = copy.deepcopy(plain), copy.deepcopy(plain)
    opt_plain, opt_managed, opt_hooked = _opt(plain), _opt(managed), _opt(hooked)
    saved = 0

    def count(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += 1
        return tensor

    batch = tuple(t.to(device) for t in w.batch(0))
    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        w.loss(plain, *batch).backward()  # type: ignore[no-untyped-call]
    times: dict[str, list[float]] = {
        k: [] for k in ("unmanaged", "unbound", "hooks", "enter", "exit")
    }
    identical = True
    with vtensor.MemoryManager(UNBOUND_BYTES) as mm:
        for r in range(warmup + rounds):
            batch = tuple(t.to(device) for t in w.batch(r))
            took: dict[str, float] = {}
            enter_s = exit_s = 0.0
            for name in _TURNS[r % 3 :] + _TURNS[: r % 3]:  # each copy in every position
                if name == "unmanaged":
                    took[name] = _plain(w, plain, opt_plain, batch)
                elif name == "hooks":
                    took[name] = _noop_hooks(w, hooked, opt_hooked, batch)
                else:
                    took[name], enter_s, exit_s = _managed(w, managed, opt_managed, batch, mm)
            identical = identical and _same_grads(plain, managed) and _same_grads(plain, hooked)
            for opt in (opt_plain, opt_managed, opt_hooked):
                opt.step()
            if r >= warmup:
                for name, seconds in (*took.items(), ("enter", enter_s), ("exit", exit_s)):
                    times[name].append(seconds)
        report = mm.report()
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    overheads = [b - a for a, b in zip(times["unmanaged"], times["unbound"], strict=True)]
    return {
        "model": w.name,
        "describe": w.describe,
        "saved_tensors": saved,
        "unmanaged_ms": ms["unmanaged"],
        "unbound_ms": ms["unbound"],
        "overhead_ms": 1e3 * statistics.median(overheads),
        "ratio": ms["unbound"] / ms["unmanaged"],
        "noop_hooks_ratio": ms["hooks"] / ms["unmanaged"],
        "enter_ms": ms["enter"],
        "exit_ms": ms["exit"],
        "lean": report.lean,
        "plan_source": report.plan_source,
        "grads_identical": identical,
        "rounds": rounds,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["mobilenet", "resnet", "gpt", "main"])
    p.add_argument("--rounds", type=int, default=60, help="timed rounds per model")
    p.add_argument("--warmup", type=int, default=6, help="untimed rounds first (profiling)")
    p.add_argument(
        "--batch-scale", type=float, default=0.25, help="scale the workloads' small batches"
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU")
    add_quick(p, "4 rounds")
    add_out(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rounds = 4 if args.quick else args.rounds
    env = environment(
        script="unbound_cost", rounds=rounds, batch_scale=args.batch_scale, device=args.device
    )
    print(describe(env), flush=True)
    zoo = {**workloads(quick=True, batch_scale=args.batch_scale), "main": _main_job_mlp()}
    device = torch.device(args.device)
    rows = []
    print(
        "| model | saved tensors | unmanaged ms | unbound ms | overhead ms | ratio "
        "| no-op hooks ratio | entering ms | leaving ms | lean | gradients identical |"
    )
    print("|---" * 11 + "|")
    for name in args.models:
        row = run_model(zoo[name], rounds, 2 if args.quick else args.warmup, device)
        rows.append(row)
        print(
            f"| {row['describe']} | {row['saved_tensors']} | {row['unmanaged_ms']:.2f} "
            f"| {row['unbound_ms']:.2f} | {row['overhead_ms']:.2f} | {row['ratio']:.3f}x "
            f"| {row['noop_hooks_ratio']:.3f}x | {row['enter_ms']:.2f} | {row['exit_ms']:.2f} "
            f"| {row['lean']} "
            f"| {row['grads_identical']} |",
            flush=True,
        )
    write_json_lines(args.out, env, tagged("model", rows))
    if not all(r["grads_identical"] for r in rows):
        sys.exit("gradients differ between the unmanaged and the managed copy")


if __name__ == "__main__":
    main()
