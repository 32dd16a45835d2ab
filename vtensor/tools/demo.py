"""Demo: train a small CNN under a memory budget below its unmanaged peak, and check the result.

Run with ``python -m vtensor`` (``--help`` for options). It trains the same model from the same
seed with and without the manager at a fraction of the unmanaged peak, prints per-iteration
memory and transfer figures, and whether the weights match bit for bit. Exit status as for
``python -m vtensor plan``: 0 done (1 if the weights differ), 2 usage error, 3 infeasible budget.
"""

import argparse
import logging
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn

from vtensor.activations.manager import MemoryManager
from vtensor.errors import BudgetFormatError, InfeasibleBudgetError
from vtensor.measure.rss import rss_is_honest
from vtensor.sizes import format_bytes, parse_bytes
from vtensor.tools.plan_run import same_weights, train_step
from vtensor.tools.workload import DEFAULT_CLASSES, Batch, make_batch

EXIT_INFEASIBLE = 3  # a budget below the smallest workable one, for demo and plan alike


def plain_text(text: str) -> str:
    """Help text without the reST markup of docstrings (double backticks)."""
    return text.replace("``", "")


def size_argument(what: str) -> Callable[[str], int]:
    """An argparse type: a byte size such as 24MiB, else a usage error naming the value."""

    def parse(text: str) -> int:
        try:
            return parse_bytes(text, what=what)
        except BudgetFormatError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return parse


def fraction_argument(text: str) -> float:
    """An argparse type: a fraction in (0, 1], else a usage error naming the value."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1], e.g. 0.5")
    return value


def add_swap_arguments(parser: argparse.ArgumentParser) -> None:
    """The options demo and plan share: --chunk-bytes, --granularity, --storage-dir."""
    parser.add_argument(
        "--chunk-bytes",
        type=size_argument("chunk_bytes"),
        default=parse_bytes("1MiB"),
        help="chunk size (default 1MiB)",
    )
    parser.add_argument(
        "--granularity",
        choices=("chunk", "tensor"),
        default="chunk",
        help="swap unit (default chunk)",
    )
    parser.add_argument("--storage-dir", help="directory of the swap file (default: a temp dir)")


def build_model() -> nn.Module:
    """A VGG-style CNN whose saved activations dominate its parameters."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    channels = 3
    for width in (32, 32, 64, 64):
        layers += [
            nn.Conv2d(channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        ]
        channels = width
        if width == 32 and len(layers) == 6:
            layers.append(nn.MaxPool2d(2))
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)]
    return nn.Sequential(*layers)


def _train(manager: MemoryManager | None, steps: int, batch: Batch) -> nn.Module:
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(steps):
        train_step(model, optimizer, batch, DEFAULT_CLASSES, manager)
    return model


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m vtensor.tools.demo``."""
    parser = argparse.ArgumentParser(
        prog="python -m vtensor [demo]", description=plain_text(__doc__ or "").splitlines()[0]
    )
    parser.add_argument(
        "--fraction",
        type=fraction_argument,
        default=0.75,
        help="budget as a fraction of the unmanaged peak (default 0.75)",
    )
    parser.add_argument(
        "--budget",
        type=size_argument("budget"),
        help="absolute budget instead, e.g. '24MiB' (overrides --fraction)",
    )
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (default 4)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    add_swap_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    batch, _ = make_batch((args.batch_size, 3, 64, 64), None, None, "cpu")

    with tempfile.TemporaryDirectory() as scratch:
        with MemoryManager("1TiB", storage_dir=scratch) as probe:
            _train(probe, 1, batch)
        peak = probe.report().peak_device_bytes
        budget = args.budget if args.budget else int(peak * args.fraction)
        print(f"unmanaged peak of one training step: {format_bytes(peak)} (tracked)")
        print(
            f"budget: {format_bytes(budget)} ({budget / peak:.0%} of the peak), "
            f"{args.granularity} granularity, chunk {format_bytes(args.chunk_bytes)}\n"
        )
        begin = time.perf_counter()
        reference = _train(None, args.steps, batch)
        plain_s = time.perf_counter() - begin
        manager = MemoryManager(
            budget,
            chunk_bytes=args.chunk_bytes,
            storage_dir=args.storage_dir or scratch,
            granularity=args.granularity,
            count_workspaces=True,  # hold the budget for the process's RSS, not only tensors
        )
        begin = time.perf_counter()
        try:
            with manager:
                managed = _train(manager, args.steps, batch)
        except InfeasibleBudgetError as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_INFEASIBLE
        managed_s = time.perf_counter() - begin

    honest = rss_is_honest()

    def independent(nbytes: int | None) -> str:
        return format_bytes(nbytes) if honest and nbytes is not None else "-"

    print(
        f"{'iter':>4} {'source':>9} {'peak':>10} {'predicted':>10} {'indep.':>10} {'out':>10} "
        f"{'in':>10} {'stall s':>8} {'wall s':>7}"
    )
    for rep in manager.reports:
        predicted = format_bytes(rep.predicted_peak_bytes) if rep.predicted_peak_bytes else "-"
        print(
            f"{rep.iteration:>4} {rep.plan_source:>9} {format_bytes(rep.peak_device_bytes):>10} "
            f"{predicted:>10} {independent(rep.peak_independent_bytes):>10} "
            f"{format_bytes(rep.bytes_out):>10} {format_bytes(rep.bytes_in):>10} "
            f"{rep.stall_s:>8.3f} {rep.wall_s:>7.2f}"
        )
    same = same_weights(reference, managed)
    print(f"\nweights after {args.steps} steps bit-identical to unmanaged training: {same}")
    print(f"time: unmanaged {plain_s:.2f} s, managed {managed_s:.2f} s")
    print(
        "peak = tracked device bytes (heap counter at every hook point); predicted = the plan's "
        "peak (with the op workspaces measured while profiling); indep. = baseline + growth of "
        "the process's peak RSS"
        + (
            ""
            if honest
            else " (not shown: RSS follows the live bytes only in a process started with "
            "MALLOC_MMAP_THRESHOLD_=65536)"
        )
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
