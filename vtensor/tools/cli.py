"""Command line of vtensor: ``python -m vtensor demo|plan``; ``plan`` profiles, plans and replays.

``plan MODEL`` builds a model (an edgefl zoo name, or ``package.module:factory``) and trains it on
one random batch: a plain step (it warms the kernels), one step at a 1 TiB budget (the unmanaged
peak and trace), then ``--steps`` iterations under a ``MemoryManager`` at the budget, which
profiles, decides and replays its plan (up to three iterations to decide, a fourth with offloaded
parameters), taking turns with ``--steps`` - 1 more plain steps (reference time and weights). It
prints the manager's stated minimum, the plan, the managed step against the plain one and against
the calibrated model's prediction, plots the iterations, and optionally writes the figures as
JSON; progress goes to stderr. Loss: cross-entropy where the output holds logits over the targets
(``(N, C)`` for ``(N,)``, ``(N, T, V)`` for ``(N, T)``), else ``output.square().mean()``. Exit
status: 0 done (1 if the managed weights differ from the plain ones), 2 usage error, 3 infeasible
budget.
"""

import argparse
import sys
from collections.abc import Sequence

from vtensor.activations.report import Granularity
from vtensor.errors import InfeasibleBudgetError
from vtensor.tools import demo
from vtensor.tools.figures import print_summary, summary, write_outputs
from vtensor.tools.plan_run import PlanRequest, Progress, measure
from vtensor.tools.workload import UsageError, load_builder, loss_name, make_batch

EXIT_INFEASIBLE = demo.EXIT_INFEASIBLE


# -- arguments ---------------------------------------------------------------------------------
def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(part) for part in text.split(","))
    except ValueError:
        dims = ()
    if not dims or min(dims) <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a shape; give positive integers separated by commas, e.g. 32,3,64,64"
        )
    return dims


_SWITCHES: dict[str, bool | str] = {"auto": "auto", "on": True, "off": False}


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m vtensor`` (``demo`` is dispatched before parsing)."""
    parser = argparse.ArgumentParser(
        prog="python -m vtensor", description=demo.plain_text(__doc__ or "").splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", metavar="{demo,plan}")
    sub.add_parser("demo", help="train a small CNN under a budget (the default; see demo --help)")
    p = sub.add_parser(
        "plan",
        help="profile MODEL, plan swaps at a budget, replay and plot them",
        description=demo.plain_text(__doc__ or "").split("\n\n", 1)[-1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help="zoo name (edgefl.models) or pkg.module:factory")
    p.add_argument("--batch-shape", type=_shape, required=True, help="input shape, e.g. 32,3,64,64")
    p.add_argument("--target-shape", type=_shape, help="targets (default: (N,), tokens: input's)")
    p.add_argument("--input-dtype", choices=("float", "long"), default="float")
    p.add_argument("--vocab", type=int, help="token vocabulary size (with --input-dtype long)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument(
        "--budget", type=demo.size_argument("budget"), help="absolute budget, e.g. 64MiB"
    )
    budget.add_argument(
        "--fraction",
        type=demo.fraction_argument,
        default=0.5,
        help="of the unmanaged peak (default 0.5)",
    )
    demo.add_swap_arguments(p)
    p.add_argument(
        "--recompute",
        action="store_true",
        help="plans may recompute modules in backward where the calibrated model predicts it "
        "faster (not with offloaded parameters)",
    )
    p.add_argument(
        "--offload-params",
        choices=tuple(_SWITCHES),
        default="auto",
        help="parameters, gradients and optimizer state in the swap tier under the same budget, "
        "planned with the activations: auto (default: where they would take over half the "
        "budget), on, off",
    )
    p.add_argument(
        "--encode-masks",
        choices=tuple(_SWITCHES),
        default="off",
        help="ReLU6/Hardtanh save their output instead of their input: on, off (default), auto "
        "(where the plan moves bytes)",
    )
    p.add_argument(
        "--steps", type=int, default=8, help="managed iterations and plain steps, each (default 8)"
    )
    p.add_argument("--plot", help="write the timeline PNG here")
    p.add_argument("--plan-cache", help="plan cache directory (shared by runs)")
    p.add_argument("--json", help="write the figures as JSON here")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.set_defaults(parser=p)  # usage errors found after parsing are reported by this parser
    return parser


# -- entry -------------------------------------------------------------------------------------
def run_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The ``plan`` subcommand."""
    if args.input_dtype == "long" and (args.vocab is None or args.vocab < 1):
        parser.error("--input-dtype long needs --vocab N (a positive vocabulary size)")
    if args.steps < 1:
        parser.error(f"--steps {args.steps} must be at least 1")
    progress = Progress()
    progress(f"building {args.model}")
    try:
        vocab = args.vocab if args.input_dtype == "long" else None
        build = load_builder(args.model, args.batch_shape, vocab)
        batch, classes = make_batch(args.batch_shape, args.target_shape, vocab, args.device)
        loss = loss_name(build, batch, classes)
        request = PlanRequest(
            batch=batch,
            classes=classes,
            steps=args.steps,
            budget_bytes=args.budget,
            fraction=args.fraction,
            chunk_bytes=args.chunk_bytes,
            granularity=Granularity(args.granularity),
            recompute=args.recompute,
            encode_masks=_SWITCHES[args.encode_masks],
            offload_params=_SWITCHES[args.offload_params],
            plan_cache_dir=args.plan_cache,
            storage_dir=args.storage_dir,
        )
        outcome = measure(request, build, progress)
    except UsageError as err:
        parser.error(str(err))
    except InfeasibleBudgetError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INFEASIBLE
    s = summary(outcome)
    print_summary(s, args, loss)
    write_outputs(outcome, s, args)
    progress("done")
    if outcome.failure is not None:
        return EXIT_INFEASIBLE
    return 0 if outcome.weights_identical else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m vtensor``; no subcommand (or only options) runs the demo."""
    words = list(sys.argv[1:] if argv is None else argv)
    if (
        not words
        or words[0] == "demo"
        or (words[0].startswith("-") and words[0] not in ("-h", "--help"))
    ):
        return demo.main(words[1:] if words[:1] == ["demo"] else words)
    parser = build_parser()
    args = parser.parse_args(words)
    return run_plan(args, args.parser)
