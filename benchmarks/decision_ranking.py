"""How well the one decision's step-time model ranks its options: predicted against measured.

A manager with ``recompute=True`` profiles one iteration and prices swapping alone and each
recomputation it considers (NOTE [one decision] in ``vtensor/activations/plan/decision.py``),
then corrects its per-byte cost from one validating replay. This script takes that profile and
those constants and, per option, the step the model predicts; then it runs every option for
real: the same weights, torch's checkpointing of exactly the option's modules, under a manager
at the same budget that only swaps (the manager's recomputation is that checkpointing). The
options take turns round by round on the same batches; a row reports each option's predicted
and measured step (median of the timed rounds), the option the manager chose, the fastest
measured, and what choosing by the model cost: the chosen option's step over the fastest's.
Run from the repository root::

    MALLOC_MMAP_THRESHOLD_=65536 python -m benchmarks.decision_ranking --out ranking.jsonl
    python -m benchmarks.decision_ranking --quick   # CI-sized: checks the script, not results
"""

import argparse
import contextlib
import copy
import functools
import statistics
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import vtensor
from benchmarks.common import add_out, add_quick, describe, environment, tagged, write_json_lines
from benchmarks.zoo.workloads import Workload, workloads
from vtensor.activations.plan.decision import PlanBook
from vtensor.planner.costs import recompute_s
from vtensor.planner.recompute import recompute_candidates
from vtensor.planner.recomputed import with_recompute

HUGE_BUDGET = 1 << 50


def _opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _step(w: Workload, model: nn.Module, opt: torch.optim.Optimizer, r: int, mm: Any) -> float:
    """One training step on round ``r``'s batch; its forward and backward seconds."""
    x, y = w.batch(r)
    opt.zero_grad(set_to_none=True)
    begin = time.perf_counter()
    if mm is None:
        w.loss(model, x, y).backward()  # type: ignore[no-untyped-call]
    else:
        with mm.step(model, opt, inputs=(x,)):
            w.loss(model, x, y).backward()  # type: ignore[no-untyped-call]
    seconds = time.perf_counter() - begin
    opt.step()
    return seconds


def _unmanaged_peak(w: Workload, base: nn.Module) -> int:
    """The tracked peak of an unmanaged step, with the optimizer's state made."""
    model = copy.deepcopy(base)
    opt = _opt(model)
    _step(w, model, opt, 0, None)
    with vtensor.MemoryManager(
        HUGE_BUDGET, policy="reactive", encode_masks=False, offload_params=False
    ) as mm:
        peak = 0
        for r in range(2):
            _step(w, model, opt, r, mm)
            peak = max(peak, mm.report().peak_device_bytes)
    return peak


def _checkpointed(model: nn.Module, names: tuple[str, ...]) -> nn.Module:
    """``model`` with the modules ``names`` under torch's checkpointing, as a manager runs them."""
    modules = dict(model.named_modules())
    for name in names:
        module = modules[name]
        module.forward = functools.partial(
            checkpoint, module.forward, use_reentrant=False, preserve_rng_state=True
        )
    return model


def _decide(w: Workload, base: nn.Module, budget: int, steps: int) -> dict[str, Any]:
    """Let a hybrid manager decide; its options priced before and after its validating replay."""
    model = copy.deepcopy(base)
    opt = _opt(model)
    with vtensor.MemoryManager(
        budget, recompute=True, encode_masks=False, offload_params=False
    ) as mm:
        priced: dict[str, Any] = {}
        for r in range(steps):
            _step(w, model, opt, r, mm)
            book = mm._plans
            decisions = list(book._decisions.values())
            if not decisions or not decisions[0].profiles:
                continue
            decision = decisions[0]
            if "profile" not in priced:
                priced["profile"] = decision.profiles[0]
                priced["at_decision"] = book.costs
            priced["after_validation"] = book.costs
            priced["stage"] = decision.stage.value
            priced["chosen"] = tuple(decision.plan.recompute) if decision.plan else None
        priced["recomputed"] = mm.report().recomputed
    return priced


def _options(priced: dict[str, Any], budget: int) -> list[dict[str, Any]]:
    """Swapping alone and each recomputation the solver considers, with predicted steps."""
    trace, reserve, minimum = priced["profile"]
    options = []
    for names in ((), *recompute_candidates(trace, budget)):
        modelled = with_recompute(trace, names) if names else trace
        row: dict[str, Any] = {"recompute": names}
        for when in ("at_decision", "after_validation"):
            book = PlanBook(budget, trace.chunk_bytes, None)
            book.costs = priced[when]
            plan = book._plan((modelled, reserve, minimum))
            seconds = None
            if plan is not None:
                seconds = book.costs.step_s(modelled, plan) + recompute_s(trace, names)
            row[f"predicted_{when}_s"] = seconds
        options.append(row)
    return options


def run_case(w: Workload, fraction: float, rounds: int, warmup: int) -> dict[str, Any]:
    """One model at one budget fraction: the options, predicted and measured."""
    torch.manual_seed(0)
    base = w.build()
    budget = int(_unmanaged_peak(w, base) * fraction)
    priced = _decide(w, base, budget, warmup)
    if "profile" not in priced:
        return {"model": w.name, "budget_fraction": fraction, "error": "no profile"}
    options = _options(priced, budget)
    plain = copy.deepcopy(base)
    plain_opt, plain_times = _opt(plain), []
    with contextlib.ExitStack() as stack:
        storage = stack.enter_context(tempfile.TemporaryDirectory(prefix="ranking-"))
        runners: list[
            tuple[dict[str, Any], nn.Module, torch.optim.Optimizer, Any, list[float]]
        ] = []
        for option in options:
            model = _checkpointed(copy.deepcopy(base), option["recompute"])
            mm = stack.enter_context(
                vtensor.MemoryManager(
                    budget,
                    recompute=False,
                    encode_masks=False,
                    offload_params=False,
                    storage_dir=storage,
                )
            )
            runners.append((option, model, _opt(model), mm, []))
        for r in range(warmup + rounds):
            order = runners if r % 2 == 0 else runners[::-1]
            for option, model, opt, mm, times in order:
                if "error" in option:
                    continue
                try:
                    seconds = _step(w, model, opt, r, mm)
                except vtensor.InfeasibleBudgetError as err:
                    option["error"] = f"infeasible: states {err.min_budget_bytes} bytes"
                    continue
                if r >= warmup:
                    times.append(seconds)
            unmanaged = _step(w, plain, plain_opt, r, None)
            if r >= warmup:
                plain_times.append(unmanaged)
        for option, _, _, mm, times in runners:
            option["measured_s"] = statistics.median(times) if times else None
            option["over_budget"] = any(r.peak_device_bytes > budget for r in mm.reports)
    unmanaged_s = statistics.median(plain_times)
    measured = [o for o in options if o.get("measured_s") is not None]
    fastest = min(measured, key=lambda o: o["measured_s"]) if measured else None
    chosen = next((o for o in options if o["recompute"] == priced.get("chosen")), None)
    cost = None
    if chosen is not None and fastest is not None and chosen.get("measured_s") is not None:
        cost = chosen["measured_s"] / fastest["measured_s"]
    return {
        "model": w.name,
        "describe": w.describe,
        "budget_fraction": fraction,
        "budget_bytes": budget,
        "unmanaged_s": unmanaged_s,
        "options": options,
        "chosen": priced.get("chosen"),
        "decided_stage": priced.get("stage"),
        "fastest": fastest["recompute"] if fastest else None,
        "choice_cost": cost,
    }


def _names(names: tuple[str, ...] | None) -> str:
    if names is None:
        return "none fits"
    if not names:
        return "swap only"
    return f"recompute {len(names)}: " + ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=None, help="default mobilenet gpt")
    p.add_argument("--budgets", nargs="+", type=float, default=None, help="default 0.5 0.4")
    p.add_argument("--rounds", type=int, default=6, help="timed rounds per option")
    p.add_argument("--warmup", type=int, default=4, help="rounds that decide (3) and warm up")
    p.add_argument("--batch-scale", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=1)
    add_quick(p, "the char GPT at batch 1, 80 %, 2 timed rounds")
    add_out(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rounds = 2 if args.quick else args.rounds
    budgets = args.budgets or ([0.8] if args.quick else [0.5, 0.4])
    models = args.models or (["gpt"] if args.quick else ["mobilenet", "gpt"])
    env = environment(script="decision_ranking", rounds=rounds, batch_scale=args.batch_scale)
    print(describe(env), flush=True)
    # CI-sized: the full models at batch 1 (the small ones' parameters hold their floors).
    zoo = workloads(quick=False, batch_scale=0.125 if args.quick else args.batch_scale)
    rows = []
    print(
        "| model | budget | option | predicted s (at decision, after validation) | measured s "
        "| ÷ unmanaged | chosen | fastest |"
    )
    print("|---" * 8 + "|")
    for name in models:
        for fraction in budgets:
            row = run_case(zoo[name], fraction, rounds, args.warmup)
            rows.append(row)
            for option in row.get("options", []):
                measured = option.get("measured_s")
                ratio = "-" if measured is None else f"{measured / row['unmanaged_s']:.2f}x"
                notes = (" (over)" if option.get("over_budget") else "") + (
                    " " + option["error"] if "error" in option else ""
                )
                print(
                    f"| {name} | {fraction:.0%} | {_names(option['recompute'])} "
                    f"| {_s(option['predicted_at_decision_s'])}, "
                    f"{_s(option['predicted_after_validation_s'])} "
                    f"| {_s(measured)}{notes} | {ratio} "
                    f"| {'yes' if option['recompute'] == row['chosen'] else ''} "
                    f"| {'yes' if option['recompute'] == row['fastest'] else ''} |",
                    flush=True,
                )
            cost = row.get("choice_cost")
            print(
                f"| {name} | {fraction:.0%} | choosing by the model costs "
                f"{'-' if cost is None else f'{cost:.2f}x'} the fastest option | | | | | |",
                flush=True,
            )
    write_json_lines(args.out, env, tagged("case", rows))


if __name__ == "__main__":
    main()
