"""The figures ``python -m vtensor plan`` prints, writes as JSON and plots, from its outcome."""

import argparse
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from vtensor.activations.report import IterationReport
from vtensor.planner.costs import moved_bytes
from vtensor.planner.plan import Plan
from vtensor.planner.trace import Trace
from vtensor.sizes import format_bytes
from vtensor.tools.plan_run import Outcome


def _bytes(n: int | None) -> str:
    return "n/a" if n is None else f"{format_bytes(n)} ({n} bytes)"


def replayed(reports: Sequence[IterationReport]) -> list[IterationReport]:
    """The iterations that replayed a plan (planned or cached), else all but the profiled one."""
    plans = [r for r in reports if r.plan_source in ("planned", "cached")]
    return plans or list(reports[1:]) or list(reports)


def steady(reports: Sequence[IterationReport]) -> list[IterationReport]:
    """The iterations after the decision: the lean replays, else every replay (``replayed``)."""
    return [r for r in reports if r.lean] or replayed(reports)


def summary(o: Outcome) -> dict[str, Any]:
    """The figures of an outcome as plain data (the JSON output)."""
    last, settled = replayed(o.managed), steady(o.managed)
    step_s = [o.managed_step_s[r.iteration] for r in settled if r.iteration < len(o.managed_step_s)]
    managed_step_s = statistics.median(step_s) if step_s else None
    plan = o.plan
    return {
        "unmanaged_peak_bytes": o.unmanaged_peak_bytes,
        "budget_bytes": o.budget_bytes,
        "min_budget_bytes": o.min_budget_bytes,
        "params_offloaded": o.params_offloaded,
        "plan_bytes_moved": _planned_bytes(plan, o.trace),
        "plan_param_tensors": _param_tensors(plan),
        "plan_encoded": plan.encoded if plan is not None else None,
        "recomputed": list(plan.recompute) if plan is not None else None,
        "predicted_peak_bytes": last[-1].predicted_peak_bytes,
        "measured_peak_bytes": max(r.peak_device_bytes for r in last),
        "measured_bytes_moved": last[-1].bytes_moved + _at(o.param_bytes_moved, last[-1]),
        "steady_iterations": [r.iteration for r in settled],
        "managed_step_s": managed_step_s,
        "plain_step_s": o.plain_step_s,
        "overhead": (
            managed_step_s / o.plain_step_s if managed_step_s and o.plain_step_s > 0 else None
        ),
        "predicted_step_s": plan.predicted_step_s if plan is not None else None,
        "measured_step_in_manager_s": statistics.median(r.wall_s for r in settled),
        "predicted_wait_s": settled[-1].predicted_stall_s,
        "measured_wait_s": statistics.median(r.stall_s for r in settled),
        "plan_sources": [r.plan_source for r in o.managed],
        "weights_identical": o.weights_identical,
        "failure": o.failure,
        "iterations": [asdict(r) for r in o.managed],
        "managed_iteration_s": list(o.managed_step_s),
        "unmanaged": asdict(o.unmanaged),
    }


def _planned_bytes(plan: Plan | None, trace: Trace | None) -> int | None:
    """Bytes a replay of ``plan`` writes and reads (a clean copy's drop moves none)."""
    if plan is None:
        return None
    if trace is None or len(trace.tensors) != len(plan.tensor_bytes):
        return plan.bytes_moved  # its trace is another process's: every move out and in
    return moved_bytes(plan, trace)


def _at(per_iteration: Sequence[int], report: IterationReport) -> int:
    return per_iteration[report.iteration] if report.iteration < len(per_iteration) else 0


def _param_tensors(plan: Plan | None) -> int | None:
    """Parameter-side tensors in a joint plan (offloaded parameters); None without a plan."""
    return None if plan is None else sum(1 for name in plan.tensor_names if name)


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f} s"


def print_summary(s: dict[str, Any], args: argparse.Namespace, loss: str) -> None:
    """The figures, one per line, for people (and tests) to read."""
    print(f"model: {args.model}, batch {tuple(args.batch_shape)} {args.input_dtype}, loss: {loss}")
    peak = s["unmanaged_peak_bytes"]
    print(f"unmanaged peak: {_bytes(peak)}, with the optimizer state its first update creates")
    print(
        f"budget: {_bytes(s['budget_bytes'])}, {s['budget_bytes'] / peak:.0%} of the peak, "
        f"{args.granularity} granularity, chunk {format_bytes(args.chunk_bytes)}"
    )
    minimum = _bytes(s["min_budget_bytes"])
    print(f"smallest feasible budget (the manager's stated minimum): {minimum}")
    _print_plan(s, args)
    print(f"bytes to move per iteration (plan): {_bytes(s['plan_bytes_moved'])}")
    print(f"predicted peak: {_bytes(s['predicted_peak_bytes'])}")
    print(f"measured peak: {_bytes(s['measured_peak_bytes'])}")
    print(f"measured bytes moved: {_bytes(s['measured_bytes_moved'])}")
    _print_time(s)
    print(f"plan source per iteration: {', '.join(s['plan_sources'])}")
    print(f"weights bit-identical to unmanaged training: {s['weights_identical']}")
    if s["failure"]:
        print(f"managed run stopped early: {s['failure']}")


def _print_plan(s: dict[str, Any], args: argparse.Namespace) -> None:
    """Where the parameter side is, what the plan recomputes, whether clamps encode."""
    held = "offloaded" if s["params_offloaded"] else "in memory"
    setting = f"--offload-params {args.offload_params}"
    print(f"parameters, gradients and optimizer state: {held} ({setting})")
    if s["params_offloaded"]:
        print(f"parameter-side tensors in the plan: {s['plan_param_tensors']}")
    recomputed = s["recomputed"]
    if not args.recompute and not recomputed:
        print("recomputed in backward: off (--recompute allows it)")
    elif s["params_offloaded"]:
        print(
            "recomputed in backward: nothing, not with offloaded parameters (--offload-params off)"
        )
    else:
        names = "n/a" if recomputed is None else ", ".join(recomputed) or "nothing"
        print(f"recomputed in backward (the replayed plan): {names}")
    if args.encode_masks != "off":
        encoded = s["plan_encoded"]
        print(f"clamps save their output (--encode-masks {args.encode_masks}): {encoded}")


def _print_time(s: dict[str, Any]) -> None:
    """The step against plain training, and the calibrated model's prediction beside it."""
    overhead = s["overhead"]
    ratio = "n/a" if overhead is None else f"{overhead:.2f}x"
    iterations = ", ".join(map(str, s["steady_iterations"]))
    print(
        f"training step (forward, backward, update): managed {_seconds(s['managed_step_s'])}, "
        f"plain {_seconds(s['plain_step_s'])}: {ratio} (medians: managed iterations "
        f"{iterations}; this process's plain steps after the first)"
    )
    print(
        f"step inside the manager: {_seconds(s['measured_step_in_manager_s'])} measured, "
        f"{_seconds(s['predicted_step_s'])} predicted by its calibrated model (measured compute "
        "+ waits for transfers + swap CPU time + recomputation)"
    )
    print(
        f"waits for transfers: {_seconds(s['measured_wait_s'])} measured, "
        f"{_seconds(s['predicted_wait_s'])} predicted (compute blocked on a swap in flight)"
    )


def plotted(o: Outcome) -> dict[str, IterationReport]:
    """The plot's runs: unmanaged, the first managed iteration, the last full and lean replays."""
    first = o.managed[0]
    runs = {
        "unmanaged (first step, 1 TiB budget)": o.unmanaged,
        f"iteration 0 ({first.plan_source})": first,
    }
    replays = replayed(o.managed[1:])
    full = [r for r in replays if r.steps]
    if full:
        runs[f"iteration {full[-1].iteration} ({full[-1].plan_source})"] = full[-1]
    lean = [r for r in replays if r.lean]
    if lean:
        runs[f"iteration {lean[-1].iteration} ({lean[-1].plan_source}, lean: its peak)"] = lean[-1]
    return runs


def write_outputs(o: Outcome, s: dict[str, Any], args: argparse.Namespace) -> None:
    """The plot and the JSON file, if asked for."""
    if args.plot:
        from vtensor.tools.timeline import plot_timeline

        title = (
            f"{args.model}, batch {tuple(args.batch_shape)}: budget {format_bytes(o.budget_bytes)}"
        )
        path = plot_timeline(
            plotted(o),
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
