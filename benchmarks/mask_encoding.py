"""Clamps that save their output, not their input: what the encoding costs and what it frees.

NOTE [mask encoding] in ``vtensor/activations/encode.py``. Two parts, in this one process:

- ``ops``: per tensor of a clamp's input size, a clamp's forward and backward through autograd
  as ``nn.ReLU6`` runs it (saving its input) against the encoding, ``MaskedHardtanh``, which
  saves its output, in microseconds, medians of ``--repeats`` taken in turn, with the kernels
  alone for reference, and whether the gradients are bit-identical;
- ``models``: the main job's CNN (``conf/config.yaml``) and the benchmarks' MobileNetV2 (its
  ReLU6 saves its input), trained unmanaged and under a manager whose budget never binds, with
  and without the encoding, the variants taking turns step by step from the same weights: the
  step time's median and its ratio to unmanaged, the bytes the profiled iteration saved for
  backward (the trace's), and whether every variant's weights stayed bit-identical.

Run from the repository root::

    python -m benchmarks.mask_encoding --out mask_encoding.jsonl
    python -m benchmarks.mask_encoding --quick    # CI-sized; its rows are not results
"""

import argparse
import copy
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
from vtensor.activations.encode import MaskedHardtanh

MIB = 1 << 20
SHAPES = {
    "main job, first block": (32, 96, 14, 14),
    "MobileNetV2, stem": (12, 32, 64, 64),
    "tiny: the calls' own cost": (8, 64),
}


def _interleaved_us(fns: dict[str, Callable[[], object]], n: int) -> dict[str, float]:
    """Each of ``fns`` timed ``n`` times, in turn, after one call each: medians in microseconds."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(n):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(t) * 1e6 for k, t in times.items()}


def ops(n: int, quick: bool) -> list[dict[str, Any]]:
    """A clamp through autograd, plain and encoded, per shape; the kernels for reference."""
    return [_op_row(name, (2, *dims[1:]) if quick else dims, n) for name, dims in SHAPES.items()]


def _op_row(name: str, shape: tuple[int, ...], n: int) -> dict[str, Any]:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 4
    grad = torch.randn(shape)

    def through(clamp: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        leaf = x.clone().requires_grad_()
        clamp(leaf).backward(grad)  # type: ignore[no-untyped-call]
        assert leaf.grad is not None
        return leaf.grad

    def plain(t: torch.Tensor) -> torch.Tensor:
        return nn.functional.relu6(t)

    def encoded(t: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = MaskedHardtanh.apply(t, 0.0, 6.0, "clamp")  # type: ignore[no-untyped-call]
        return out

    bits = through(plain).view(torch.int32)
    same = torch.equal(bits, through(encoded).view(torch.int32))
    timed = {
        "forward kernel": lambda: torch.ops.aten.hardtanh(x, 0.0, 6.0),
        "backward kernel": lambda: torch.ops.aten.hardtanh_backward(grad, x, 0.0, 6.0),
        "clone": lambda: x.clone(),
        "clamp forward and backward, plain": lambda: through(plain),
        "clamp forward and backward, encoded": lambda: through(encoded),
    }
    row: dict[str, Any] = {"shape": name, "dims": list(shape), "mib": x.nbytes / MIB}
    row |= _interleaved_us(timed, n)
    row |= {"gradient_identical": same}
    return row


def models(steps: int, quick: bool) -> list[dict[str, Any]]:
    """Unmanaged against a budget that never binds, encoded and not, step by step."""
    w = workloads(quick, 0.5)["mobilenet"]
    cases = [main_job_model(), (w.describe, w.build(), w.batch)]
    rows = []
    storage = tempfile.mkdtemp(prefix="mask-encoding-")
    for describe_model, start, batch in cases:
        names = ("unmanaged", "unbound, plain", "unbound, encoded")
        nets = {n: copy.deepcopy(start) for n in names}
        opts = {n: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for n, m in nets.items()}
        managers = {
            n: vtensor.MemoryManager(
                1 << 40, storage_dir=storage, encode_masks=n.endswith("encoded")
            )
            for n in names[1:]
        }
        times: dict[str, list[float]] = {n: [] for n in names}
        saved: dict[str, int] = {}
        for i in range(steps + 2):
            x, y = batch(i)
            for n in names:
                opts[n].zero_grad(set_to_none=True)
                began = time.perf_counter()
                if n in managers:
                    with managers[n].step(nets[n], opts[n], (x, y)):
                        nn.functional.cross_entropy(nets[n](x), y).backward()  # type: ignore[no-untyped-call]
                else:
                    nn.functional.cross_entropy(nets[n](x), y).backward()  # type: ignore[no-untyped-call]
                opts[n].step()
                if i >= 2:  # the profiled iteration and the first replay are left out
                    times[n].append(time.perf_counter() - began)
                trace = managers[n].trace if n in managers else None
                if trace is not None and n not in saved:
                    saved[n] = sum(t.nbytes for t in trace.tensors) + trace.unmanaged_saved_bytes
        for m in managers.values():
            m.close()
        base = statistics.median(times["unmanaged"])
        params = {n: list(nets[n].parameters()) for n in names}
        for n in names:
            identical = all(
                torch.equal(a, b) for a, b in zip(params[n], params["unmanaged"], strict=True)
            )
            median = statistics.median(times[n])
            rows.append(
                {
                    "model": describe_model,
                    "variant": n,
                    "step_s_median": median,
                    "vs_unmanaged": median / base,
                    "saved_mib": saved[n] / MIB if n in saved else None,
                    "weights_identical": identical,
                    "steps": len(times[n]),
                }
            )
    return rows


def main() -> None:
    """Parse arguments, run both parts, print the tables, write the JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    add_repeats(parser, "timings per op", full=50, quick=3)
    add_quick(parser, "CI-sized tensors and models, two steps")
    add_out(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    env = environment(script="mask_encoding", steps=args.steps)
    print(describe(env), flush=True)
    op_rows = ops(repeats(args, 50, 3), args.quick)
    keys = [k for k in op_rows[0] if k not in ("shape", "dims", "mib")]
    print("| shape | MiB | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for r in op_rows:
        cells = " | ".join(f"{r[k]:.0f}" if isinstance(r[k], float) else str(r[k]) for k in keys)
        print(f"| {r['shape']} {tuple(r['dims'])} | {r['mib']:.2f} | {cells} |")
    model_rows = models(2 if args.quick else args.steps, args.quick)
    print("\n| model | variant | step s | vs unmanaged | saved MiB | weights identical |")
    print("|---|---|---|---|---|---|")
    for r in model_rows:
        saved = "-" if r["saved_mib"] is None else f"{r['saved_mib']:.1f}"
        print(
            f"| {r['model']} | {r['variant']} | {r['step_s_median']:.4f} | "
            f"{r['vs_unmanaged']:.2f}x | {saved} | {'yes' if r['weights_identical'] else 'NO'} |"
        )
    write_json_lines(args.out, env, [*tagged("op", op_rows), *tagged("model", model_rows)])


if __name__ == "__main__":
    main()
