"""Command line of vtensor: ``python -m vtensor demo|plan``; ``plan`` profiles, plans and replays.

``plan MODEL`` builds a model (an edgefl zoo name, or ``package.module:factory``) and trains it on
one random batch: ``--steps`` plain steps (reference time and weights; they warm the kernels), one
step at a 1 TiB budget (the unmanaged peak and trace), then ``--steps`` iterations under a
``MemoryManager`` at the budget, which profiles, plans and replays. It prints the figures, plots
the unmanaged and managed iterations, and optionally writes the figures as JSON; progress goes to
stderr. Loss: cross-entropy where the output holds logits over the targets (``(N, C)`` for
``(N,)``, ``(N, T, V)`` for ``(N, T)``), else ``output.square().mean()``. Exit status: 0 done (1
if the managed weights differ from the plain ones), 2 usage error, 3 infeasible budget.
"""

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from vtensor.activations.report import Granularity, IterationReport
from vtensor.errors import InfeasibleBudgetError
from vtensor.planner.plan import Plan
from vtensor.sizes import format_bytes, parse_bytes
from vtensor.tools import demo
from vtensor.tools.plan_run import Outcome, PlanRequest, Progress, measure, planner_minimum
from vtensor.tools.workload import UsageError, load_builder, loss_name

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


_size = demo.size_argument
_fraction = demo.fraction_argument


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
    budget.add_argument("--budget", type=_size("budget"), help="absolute budget, e.g. 64MiB")
    budget.add_argument(
        "--fraction", type=_fraction, default=0.5, help="of the unmanaged peak (default 0.5)"
    )
    p.add_argument(
        "--chunk-bytes", type=_size("chunk_bytes"), default=parse_bytes("1MiB"), help="default 1MiB"
    )
    p.add_argument("--granularity", choices=("chunk", "tensor"), default="chunk")
    p.add_argument(
        "--offload-params",
        action="store_true",
        help="also keep parameters, gradients and momentum in the swap tier (ParamOffload), "
        "planned with the activations under the one budget",
    )
    p.add_argument("--steps", type=int, default=3, help="managed iterations (default 3)")
    p.add_argument("--plot", help="write the timeline PNG here")
    p.add_argument("--plan-cache", help="plan cache directory (shared by runs)")
    p.add_argument("--json", help="write the figures as JSON here")
    p.add_argument("--storage-dir", help="directory of the swap file (default: a temp dir)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.set_defaults(parser=p)  # usage errors found after parsing are reported by this parser
    return parser


# -- output ------------------------------------------------------------------------------------
def _bytes(n: int | None) -> str:
    return "n/a" if n is None else f"{format_bytes(n)} ({n} bytes)"


def replayed(reports: Sequence[IterationReport]) -> list[IterationReport]:
    """The iterations that replayed a plan (planned or cached), else all but the profiled one."""
    plans = [r for r in reports if r.plan_source in ("planned", "cached")]
    return plans or list(reports[1:]) or list(reports)


def summary(o: Outcome) -> dict[str, Any]:
    """The figures of an outcome as plain data (the JSON output)."""
    last = replayed(o.managed)
    step_s = statistics.median(r.wall_s for r in last)
    reactive = [r.min_budget_bytes for r in o.managed if r.policy == "reactive"]
    floor, floor_step = planner_minimum(o.trace or o.unmanaged_trace, o.chunk_bytes)
    unmanaged_floor, _ = planner_minimum(o.unmanaged_trace, o.chunk_bytes)
    return {
        "unmanaged_peak_bytes": o.unmanaged.peak_device_bytes,
        "budget_bytes": o.budget_bytes,
        "min_budget_planner_bytes": floor,
        "min_budget_planner_step": floor_step,
        "min_budget_planner_unmanaged_trace_bytes": unmanaged_floor,
        "min_budget_reactive_bytes": reactive[0] if reactive else None,
        "plan_bytes_moved": o.plan.bytes_moved if o.plan is not None else None,
        "plan_param_tensors": _param_tensors(o.plan),
        "predicted_peak_bytes": last[-1].predicted_peak_bytes,
        "predicted_stall_s": last[-1].predicted_stall_s,
        "measured_peak_bytes": max(r.peak_device_bytes for r in last),
        "measured_bytes_moved": last[-1].bytes_moved,
        "measured_stall_s": statistics.median(r.stall_s for r in last),
        "step_s": step_s,
        "unmanaged_step_s": o.unmanaged_step_s,
        "overhead": step_s / o.unmanaged_step_s if o.unmanaged_step_s > 0 else None,
        "plan_sources": [r.plan_source for r in o.managed],
        "weights_identical": o.weights_identical,
        "failure": o.failure,
        "iterations": [asdict(r) for r in o.managed],
        "unmanaged": asdict(o.unmanaged),
    }


def _param_tensors(plan: Plan | None) -> int | None:
    """Parameter-side tensors in a joint plan (``--offload-params``); None without a plan."""
    return None if plan is None else sum(1 for name in plan.tensor_names if name)


def print_summary(s: dict[str, Any], args: argparse.Namespace, loss: str) -> None:
    """The figures, one per line, for people (and tests) to read."""
    peak = s["unmanaged_peak_bytes"]
    print(f"model: {args.model}, batch {tuple(args.batch_shape)} {args.input_dtype}, loss: {loss}")
    print(f"unmanaged peak: {_bytes(peak)}")
    print(
        f"budget: {_bytes(s['budget_bytes'])}, {s['budget_bytes'] / peak:.0%} of the peak, "
        f"{args.granularity} granularity, chunk {format_bytes(args.chunk_bytes)}"
    )
    print(
        f"smallest feasible budget (planner): {_bytes(s['min_budget_planner_bytes'])} "
        f"at {s['min_budget_planner_step']!r}"
    )
    unmanaged_floor = s["min_budget_planner_unmanaged_trace_bytes"]
    print(f"smallest feasible budget (planner, unmanaged trace): {_bytes(unmanaged_floor)}")
    print(f"smallest feasible budget (reactive run): {_bytes(s['min_budget_reactive_bytes'])}")
    print(f"bytes to move per iteration (plan): {_bytes(s['plan_bytes_moved'])}")
    if args.offload_params:
        print(f"parameter-side tensors in the plan: {s['plan_param_tensors']}")
    print(f"predicted peak: {_bytes(s['predicted_peak_bytes'])}")
    stall = s["predicted_stall_s"]
    print(f"predicted stall: {'n/a' if stall is None else f'{stall:.4f} s'}")
    print(f"measured peak: {_bytes(s['measured_peak_bytes'])}")
    print(f"measured bytes moved: {_bytes(s['measured_bytes_moved'])}")
    print(f"measured stall: {s['measured_stall_s']:.4f} s")
    overhead = s["overhead"]
    print(
        f"step time: {s['step_s']:.4f} s managed vs {s['unmanaged_step_s']:.4f} s unmanaged "
        f"(overhead {'n/a' if overhead is None else f'{overhead:.2f}x'})"
    )
    print(f"plan source per iteration: {', '.join(s['plan_sources'])}")
    print(f"weights bit-identical to unmanaged training: {s['weights_identical']}")
    if s["failure"]:
        print(f"managed run stopped early: {s['failure']}")


def write_outputs(o: Outcome, s: dict[str, Any], args: argparse.Namespace) -> None:
    """The plot and the JSON file, if asked for."""
    if args.plot:
        from vtensor.tools.timeline import plot_timeline

        runs = {"unmanaged": o.unmanaged, f"iteration 0 ({o.managed[0].plan_source})": o.managed[0]}
        if len(o.managed) > 1:
            last = o.managed[-1]
            runs[f"iteration {last.iteration} ({last.plan_source})"] = last
        title = (
            f"{args.model}, batch {tuple(args.batch_shape)}: budget {format_bytes(o.budget_bytes)}"
        )
        path = plot_timeline(
            runs,
            o.budget_bytes,
            args.plot,
            trace=o.trace or o.unmanaged_trace,
            plan=o.plan,
            title=title,
        )
        print(f"plot: {path}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {"model": args.model, "batch_shape": list(args.batch_shape), **s}, f, indent=1
            )
        print(f"json: {args.json}")


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
        build = load_builder(args.model, tuple(args.batch_shape), vocab)
        request = PlanRequest(
            batch_shape=tuple(args.batch_shape),
            target_shape=tuple(args.target_shape) if args.target_shape else None,
            input_dtype=args.input_dtype,
            vocab=args.vocab,
            device=args.device,
            steps=args.steps,
            budget_bytes=args.budget,
            fraction=args.fraction,
            chunk_bytes=args.chunk_bytes,
            granularity=Granularity(args.granularity),
            offload_params=args.offload_params,
            plan_cache_dir=args.plan_cache,
            storage_dir=args.storage_dir,
        )
        batch, classes = request.batch()
        loss = loss_name(build, batch, classes)
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
