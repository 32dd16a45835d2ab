"""Recomputing part of a cover and swapping the rest, against recomputing all of it.

The hybrid planner's first candidate is the cheapest cover of the deficit by recomputation
(``choose_recompute``, NOTE [hybrid plan] in ``vtensor/planner/recompute.py``); whatever a
candidate leaves over the budget is swapped. Capuchin's rule, swap first and recompute where a
swap cannot hide, suggests mixes: recompute only part of the cover and swap what it leaves. This
script measures every such mix of the main job's model at one device class's budget. One
iteration is profiled (swap-only, as the manager's first one is) and the cheapest cover read
from it; then every subset of the cover's units (the empty one: swapping alone) is planned
from that trace, with what the plan predicts (MiB moved a step, the stall the planner's default
bandwidths give, and the measured forward time of the units recomputed), and trained under a
manager of its own in which that subset is the only candidate and wins the race: the plan a
mix gets is the one the manager would make for it. The mixes and an unmanaged copy of the model
then take turns, a round of 12 steps each, from their own copies of the same weights; per mix,
the median step, the median of its round's ratio to the unmanaged round of the same turn, and
the MiB a step moved. Swapping alone and the whole cover also run as "every hook": every
replay checks every saved tensor and step, as a swapping replay did before sparse replays
(NOTE [sparse replay] in ``vtensor/activations/sparse.py``); swapping alone also as "whole-step
saves", sparse replays whose saved-tensor hooks are in force for the whole step, as before
windowed saves (NOTE [windowed saves] in ``vtensor/activations/windows.py``). Training under
each plan is bit-identical to training without it (the equivalence tests); the copies here
train different numbers of steps before the timed rounds, so their weights are not compared.
Run from the repository root::

    python -m benchmarks.cover_mixes --rounds 8 --out cover_mixes.jsonl      # the micro class
    python -m benchmarks.cover_mixes --device-class small
    python -m benchmarks.cover_mixes --quick    # CI-sized; its rows are not results
"""

import argparse
import contextlib
import copy
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
from torch import nn

import vtensor
import vtensor.activations.runtime.iteration as iteration
import vtensor.activations.plan.decision as planning
import vtensor.activations.quiet as quiet
from benchmarks.common import (
    add_out,
    add_quick,
    client_zero,
    describe,
    environment,
    split_overrides,
    tagged,
    write_json_lines,
)
from edgefl.config import load_run_settings
from edgefl.settings import RunSettings
from edgefl.train import loss_fn
from vtensor.activations.race import PlanRace
from vtensor.planner.belady import plan_lgm
from vtensor.planner.recompute import recompute_candidates
from vtensor.planner.recomputed import with_recompute
from vtensor.planner.trace import Trace

MIB = 1 << 20
STEPS = 12  # a round of the main job's client: 384 examples at batch 32
MAX_UNITS = 4  # every subset of a cover of up to this many units; its prefixes beyond
Mix = tuple[tuple[str, ...], tuple[str, ...]]  # (units recomputed, those selectively)
Batch = tuple[torch.Tensor, torch.Tensor]
PREDICTED = ("predicted_out_mib", "predicted_stall_ms", "recompute_ms")


class _FirstWins(PlanRace):
    """A race whose first candidate wins: the mix pinned, not the swap-only plan."""

    def _best(self) -> int:
        return 0


def _step(model: nn.Module, opt: torch.optim.Optimizer, mm: Any, batch: Batch) -> None:
    x, y = batch
    opt.zero_grad(set_to_none=True)
    with mm.step(model, opt, (x, y)) if mm is not None else contextlib.nullcontext():
        loss_fn(model(x), y).backward()  # type: ignore[no-untyped-call]
    opt.step()


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _mixes(cover: Mix) -> list[Mix]:
    """Every subset of ``cover``'s units, fewest first (prefixes where it is large)."""
    units, selective = cover
    if len(units) <= MAX_UNITS:
        subsets = [s for k in range(len(units) + 1) for s in itertools.combinations(units, k)]
    else:
        subsets = [units[:k] for k in range(len(units) + 1)]
    return [(s, tuple(n for n in selective if n in s)) for s in subsets]


def _predicted(trace: Trace, budget: int, mix: Mix) -> dict[str, Any]:
    """What the planner predicts for ``mix``: MiB moved a step, stall, recomputation time."""
    units, selective = mix
    planned = with_recompute(trace, list(units), list(selective)) if units else trace
    plan = plan_lgm(planned, budget, chunk_bytes=trace.chunk_bytes)
    times = {u.name: (u.selective_s if u.name in selective else u.forward_s) for u in trace.units}
    return {
        "predicted_out_mib": sum(m.evict_bytes for m in plan.moves) / MIB,
        "predicted_stall_ms": plan.predicted_stall_s * 1e3,
        "recompute_ms": sum(times[n] for n in units) * 1e3,
    }


@contextlib.contextmanager
def _pinned(mix: Mix) -> Iterator[None]:
    """Managers decide for ``mix`` alone (while the block lasts: their first iterations)."""
    only: Callable[[Trace, int], tuple[Mix, ...]] = lambda _t, _b: (mix,) if mix[0] else ()  # noqa: E731
    with (
        mock.patch.object(planning, "recompute_candidates", only),
        mock.patch.object(planning, "PlanRace", _FirstWins),
    ):
        yield


@contextlib.contextmanager
def _every_hook() -> Iterator[None]:
    """Replays that are never quiet or sparse and keep every hook (NOTE [quiet replay])."""
    with (
        mock.patch.object(quiet, "QUIET_RUN", -1),
        mock.patch.object(quiet, "replays_sparsely", lambda _executor: False),
        mock.patch.object(quiet, "replays_hookless", lambda _executor: False),
        mock.patch.object(iteration, "replays_hookless", lambda _executor: False),
    ):
        yield


_EVERY_HOOK, _WHOLE_STEP = "every_hook", "whole_step"


@contextlib.contextmanager
def _whole_step_saves() -> Iterator[None]:
    """Sparse replays whose saved-tensor hooks are in force for the whole step."""
    with mock.patch.object(quiet.QuietTurns, "windows", lambda _self, _executor: None):
        yield


def run(args: argparse.Namespace, settings: RunSettings) -> list[dict[str, Any]]:
    """Profile, plan and train every mix; one row per mix and one for unmanaged."""
    c = settings.client
    data, start, peak = client_zero(settings)
    size = c.train.batch_size
    device = next(d for d in c.fleet.classes if d.name == args.device_class)
    budget = device.budget.of_peak(peak.unmanaged_peak_bytes)
    batches = [
        (torch.from_numpy(data.x[idx]), torch.from_numpy(data.y[idx]))
        for idx in (np.random.default_rng(i).choice(len(data), size, False) for i in range(STEPS))
    ]
    root = Path(tempfile.mkdtemp(prefix="cover-mixes-"))

    def manager(cache: Path | None = None) -> vtensor.MemoryManager:
        return vtensor.MemoryManager(
            budget,
            chunk_bytes=c.vtensor.chunk_bytes,
            storage_dir=root,
            plan_cache_dir=cache,
            recompute=True,
            encode_masks=c.vtensor.encode_masks,
        )

    model = copy.deepcopy(start)
    with manager() as probe:
        _step(model, _sgd(model), probe, batches[0])
        trace = probe.trace
    assert trace is not None
    candidates = recompute_candidates(trace, budget)
    cover: Mix = candidates[0] if candidates else ((), ())
    print(
        f"# {c.model.name}, batch {size}, class {device.name}: budget {budget / MIB:.1f} MiB "
        f"({budget / peak.unmanaged_peak_bytes:.0%} of {peak.unmanaged_peak_bytes / MIB:.1f}); "
        f"cheapest cover: {', '.join(cover[0]) or 'none'}",
        flush=True,
    )
    plain = copy.deepcopy(start)
    variants: list[dict[str, Any]] = [
        {"mix": None, "units": "unmanaged", "model": plain, "opt": _sgd(plain), "cache": None}
    ]
    for n, mix in enumerate(_mixes(cover)):
        # Decided in a manager of its own, the mix its only candidate; each timed round then
        # opens a fresh manager on the plan cache, as a round of the main job does. Managers
        # held open side by side would each keep a transfer thread, and the heap counter's
        # readings walk one more malloc arena per thread.
        model = copy.deepcopy(start)
        opt = _sgd(model)
        cache = root / f"plans-{n}"
        with _pinned(mix), manager(cache) as mm:
            for i in range(3 * STEPS):  # the profile, the trial, the race, then planned
                _step(model, opt, mm, batches[i % STEPS])
                if i >= 2 and mm.report().plan_source == "planned":
                    break
            decided = str(mm.report().plan_source)
        units = ", ".join(f"{n} (selective)" if n in mix[1] else n for n in mix[0])
        variants.append(
            {
                "mix": mix,
                "units": units or "none (swap only)",
                "model": model,
                "opt": opt,
                "cache": cache,
                "decided": decided,
                **_predicted(trace, budget, mix),
            }
        )
    # Swapping alone and the whole cover once more, each replayed as every replay checking
    # every saved tensor and step: the module boundaries, the saved-tensor hooks and every
    # watched reading, which a quiet replay (moving nothing) or a sparse one (swapping) leaves
    # out (NOTE [quiet replay], NOTE [sparse replay]); the difference is what they cost a step.
    # Swapping alone also as a sparse replay whose saved-tensor hooks are in force for the
    # whole step, as before windowed saves (NOTE [windowed saves] in activations/windows.py).
    alone, whole = variants[1], variants[-1]
    for how, label in ((_WHOLE_STEP, "whole-step saves"), (_EVERY_HOOK, "every hook")):
        for again in [alone, *([whole] if cover[0] and how == _EVERY_HOOK else [])]:
            model = copy.deepcopy(again["model"])
            units = f"{again['units']}, {label}"
            variants.append({**again, "units": units, "model": model, "opt": _sgd(model), how: 1})
            variants[-1]["opt"].load_state_dict(again["opt"].state_dict())
    for v in variants:
        v.update(rounds=[], moved=[], lean=[], sources=set())
    for _ in range(args.rounds):
        for v in variants:
            opened = manager(v["cache"]) if v["cache"] else None
            with (
                _every_hook() if v.get(_EVERY_HOOK) else contextlib.nullcontext(),
                _whole_step_saves() if v.get(_WHOLE_STEP) else contextlib.nullcontext(),
                opened or contextlib.nullcontext() as timed,
            ):
                begin = time.perf_counter()
                for b in batches:
                    _step(v["model"], v["opt"], timed, b)
                v["rounds"].append(time.perf_counter() - begin)
                if timed is not None:
                    v["moved"] += [r.bytes_out for r in timed.reports]
                    v["lean"] += [r.lean for r in timed.reports]
                    v["sources"] |= {str(r.plan_source) for r in timed.reports}
    reference = variants[0]["rounds"]
    rows = []
    for v in variants:
        ratios = [a / b for a, b in zip(v["rounds"], reference, strict=True)]
        rows.append(
            {
                "model": c.model.name,
                "device_class": device.name,
                "budget_bytes": budget,
                "units": v["units"],
                "recomputed": list(v["mix"][0]) if v["mix"] is not None else None,
                "selective": list(v["mix"][1]) if v["mix"] is not None else None,
                "decided": v.get("decided"),
                "timed_sources": sorted(v["sources"]),
                "step_ms": statistics.median(v["rounds"]) / STEPS * 1e3,
                "paired_ratio": statistics.median(ratios),
                "out_mib_per_step": statistics.median(v["moved"]) / MIB if v["moved"] else 0.0,
                "lean_share": sum(v["lean"]) / len(v["lean"]) if v["lean"] else None,
                **{k: v.get(k) for k in PREDICTED},
            }
        )
    return rows


def _cell(value: Any, form: str) -> str:
    return "-" if value is None else format(value, form)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments, run, print the table, write the JSON lines."""
    own, overrides = split_overrides(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds (default 8)")
    parser.add_argument(
        "--device-class", default="micro", help="the fleet class whose budget (default micro)"
    )
    add_quick(parser, "two rounds")
    add_out(parser)
    args = parser.parse_args(own)
    if args.quick:
        args.rounds = 2
    settings = load_run_settings(overrides)
    torch.set_num_threads(settings.client.train.torch_threads)  # as the clients train
    env = environment(script="cover_mixes", overrides=overrides, rounds=args.rounds)
    print(describe(env), flush=True)
    started = time.perf_counter()
    rows = run(args, settings)
    print(
        "\n| units recomputed | predicted: MiB out | stall ms | recompute ms "
        "| measured: step ms | paired ratio | MiB out a step | lean replays |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['units']} | {_cell(r['predicted_out_mib'], '.1f')} "
            f"| {_cell(r['predicted_stall_ms'], '.1f')} | {_cell(r['recompute_ms'], '.1f')} "
            f"| {r['step_ms']:.1f} | {r['paired_ratio']:.2f}x | {r['out_mib_per_step']:.1f} "
            f"| {_cell(r['lean_share'], '.0%')} |"
        )
    print(f"# total {time.perf_counter() - started:.0f} s", flush=True)
    write_json_lines(args.out, env, tagged("cover_mixes", rows))


if __name__ == "__main__":
    main()
