"""The main job's local round under vtensor against the same round unmanaged, side by side.

What a client of the main job does each round, without the simulation engine between: client
0's data, the model and the local round from the main job's configuration (``conf/config.yaml``;
Hydra overrides after ``--``), trained in this one process unmanaged and under each device
class's budget, swap-only (``vtensor.recompute=false``) and with recomputation (the main job's
setting). The variants take turns round by round, each round from the same
starting weights, so every managed round is set against an unmanaged one run under the same
load. Round 1 of a variant decides its plan (NOTE [one decision] in
``vtensor/activations/plan/decision.py``: a profile, with recomputation or newly encoded clamps a
reprofile, and a validating replay) and fills the plan cache its class shares, as in a
simulation; it is reported apart. Every later
round opens a fresh manager that loads the cached plan, as each round of a simulated client does.

Beside them, what a user would do instead, unmanaged: ``torch.utils.checkpoint``
(``use_reentrant=False``) on every stage of the model (``checkpoint_stages``: a CNN's
``features`` stages, an MLP's linear layers), whole (``checkpoint``) or keeping the
convolutions' and matrix products' outputs (``selective``: torch's selective activation
checkpointing with ``benchmarks.zoo.blocks.save_products``),
and, per device class, checkpointing exactly the modules the main job's plan for that class
recomputes (``checkpoint-<class>``: the manager's choice made by torch's own mechanism, from the
round after the plan is decided). Their peaks are measured as the unmanaged one's (the
manager's heap-counter readings over a step under a budget that never binds), or as their live
tensors' peak where that is higher (recomputation runs between the manager's readings), so each
class's summary line names the fastest of them whose peak fits its budget and sets the main job's
setting against it, and against ``checkpoint-<class>`` round by round (the median of the two
rounds' ratio in each turn: what the manager adds to the same recomputation).

Per variant: the median round time of rounds 2 to N and its ratio to the unmanaged round's
median (the target: 1.15x), the median of the per-round ratios (each managed round against the
unmanaged round of the same turn), round 1's time, MiB moved out per round, the tracked peak
against the budget, each round's plan source, and whether the weights after each round are
bit-identical to the unmanaged round's.

The process keeps glibc's default allocator settings, as the main job's clients do, so RSS
figures are not taken here. Run from the repository root::

    python -m benchmarks.main_round --rounds 7 --out main_round.jsonl
    python -m benchmarks.main_round --quick    # CI-sized (< 1 min); its rows are not results
"""

import argparse
import copy
import functools
import json
import re
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

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
from benchmarks.zoo.blocks import save_products
from edgefl.config import load_run_settings
from edgefl.peak import measure_unmanaged_peak
from edgefl.settings import RunSettings, VTensorSettings
from edgefl.train import (
    LocalRound,
    TrainOutcome,
    loss_fn,
    seed_everything,
    settings_round,
    train_local,
    train_within_budget,
)
from vtensor.measure.dispatch import LiveStorageTracker
from vtensor.planner.plan import Plan

MIB = 1 << 20


@dataclass
class Variant:
    """One way to train the round: unmanaged, or under a device class's budget."""

    name: str
    budget_bytes: int | None = None
    settings: VTensorSettings | None = None
    cache_dir: Path | None = None
    # Unmanaged, with these modules under torch.utils.checkpoint (by qualified name); None:
    # none. ``follows``: the managed variant whose decided plan names them (filled once it is).
    checkpointed: tuple[str, ...] | None = None
    selective: tuple[str, ...] = ()  # of those, the ones under selective checkpointing (SAC)
    follows: "Variant | None" = None
    peak_bytes: int | None = None  # a baseline's peak (``_baseline_peak``)
    first: int = -1  # the first round it ran (0-based): baselines that follow a plan start late
    round_s: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # against the same turn's unmanaged round
    outcomes: list[TrainOutcome] = field(default_factory=list)
    identical: list[bool] = field(default_factory=list)


def checkpointed_modules(
    model: nn.Module, names: Sequence[str], selective: Sequence[str]
) -> nn.Module:
    """``model`` with each module named in ``names`` run under ``torch.utils.checkpoint``.

    Those also in ``selective`` keep their convolutions' and matrix products' outputs (torch's
    selective activation checkpointing, ``save_products``).
    """
    context = functools.partial(create_selective_checkpoint_contexts, save_products)
    for name in names:
        module = model.get_submodule(name)
        own = module.forward
        if name in selective:
            module.forward = functools.partial(  # type: ignore[method-assign]
                checkpoint, own, use_reentrant=False, context_fn=context
            )
        else:
            module.forward = functools.partial(checkpoint, own, use_reentrant=False)  # type: ignore[method-assign]
    return model


def checkpoint_stages(model: nn.Module) -> tuple[str, ...]:
    """The modules the checkpoint baselines wrap: the stages of a model's ``features``, else
    (a model without one, as the MLP) every module that holds parameters of its own.

    A stage is a module with a ``forward`` of its own, so that wrapping it checkpoints it.
    """
    if hasattr(model, "features"):
        return tuple(f"features.{n}" for n, _ in model.get_submodule("features").named_children())
    return tuple(
        name
        for name, module in model.named_modules()
        if name and any(True for _ in module.parameters(recurse=False))
    )


_ENTRY = re.compile(r"^[0-9a-f]{64}\.json$")


def _baseline_peak(start: nn.Module, v: Variant, data: Any, batch_size: int) -> int:
    """A baseline's peak: its tracked peak, measured as the unmanaged round's
    (``measure_unmanaged_peak``), or its live tensors' where higher.

    The tracked peak is read at the measuring manager's hook points; checkpointing recomputes
    inside backward's unpacks, between two of them, so its working set peaks unseen there. The
    live tensors' peak (``LiveStorageTracker``, every allocation) is exact without a manager.
    """
    model = checkpointed_modules(copy.deepcopy(start), v.checkpointed or (), v.selective)
    tracked = measure_unmanaged_peak(model, data, batch_size).unmanaged_peak_bytes
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = (torch.from_numpy(a[:batch_size]) for a in (data.x, data.y))
    for _ in range(2):  # the second step runs with the momentum the first made
        optimizer.zero_grad(set_to_none=True)
        tracker = LiveStorageTracker("cpu")
        tracker.track(*model.parameters(), *model.buffers(), x, y)
        tracker.track(*(t for st in optimizer.state.values() for t in st.values()))
        with tracker:
            tracker.reset_peak()
            loss_fn(model(x), y).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    return max(tracked, tracker.peak_bytes)


def decided_plan(cache_dir: Path | None) -> Plan | None:
    """The newest decided plan in a plan cache directory (None while undecided)."""
    if cache_dir is None or not cache_dir.is_dir():
        return None
    entries = sorted(
        (p for p in cache_dir.iterdir() if _ENTRY.match(p.name)), key=lambda p: p.stat().st_mtime
    )
    if not entries:
        return None
    return Plan.from_json(json.loads(entries[-1].read_text())["plan"])


def _round(v: Variant, model: nn.Module, data: Any, local: LocalRound) -> TrainOutcome:
    if v.settings is None:
        if v.checkpointed:
            model = checkpointed_modules(model, v.checkpointed, v.selective)
        return train_local(model, data, local)
    assert v.budget_bytes is not None and v.cache_dir is not None
    return train_within_budget(
        model,
        data,
        local,
        settings=v.settings,
        budget_bytes=v.budget_bytes,
        plan_cache_dir=v.cache_dir,
    )


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def run(args: argparse.Namespace, settings: RunSettings) -> list[dict[str, Any]]:
    """Every variant's rounds, interleaved; one result row per variant."""
    c = settings.client
    data, start, peak = client_zero(settings)
    local = settings_round(c.train, c.seed, args.max_examples)
    root = Path(tempfile.mkdtemp(prefix="main-round-"))
    variants = [Variant("unmanaged")]
    stages = checkpoint_stages(start)
    baselines = [
        Variant("checkpoint", checkpointed=stages),
        Variant("selective", checkpointed=stages, selective=stages),
    ]
    for device in c.fleet.classes:
        budget = device.budget.of_peak(peak.unmanaged_peak_bytes)
        for recompute in (False, True):
            for masks in _mask_settings(args.masks):
                suffix = {True: "+masks", "auto": "+auto"}.get(masks, "")
                name = device.name + "+recompute" * recompute + suffix
                vt = replace(c.vtensor, enabled=True, recompute=recompute, encode_masks=masks)
                variants.append(Variant(name, budget, vt, root / name))
        # The main job's setting for this class: the last variant with recomputation.
        baselines.append(Variant(f"checkpoint-{device.name}", follows=variants[-1]))
    for b in baselines:
        if b.checkpointed:
            b.peak_bytes = _baseline_peak(start, b, data, c.train.batch_size)
    variants[1:1] = baselines
    print(
        f"# {c.model.name} on {c.data.name}, batch {c.train.batch_size}: parameters+gradients+"
        f"momentum {peak.state_bytes / MIB:.1f} MiB, unmanaged peak "
        f"{peak.unmanaged_peak_bytes / MIB:.1f} MiB; {len(data)} examples a round",
        flush=True,
    )
    for r in range(args.rounds):
        reference: nn.Module | None = None
        reference_s = 0.0
        for v in variants:
            if v.follows is not None and v.checkpointed is None:
                plan = decided_plan(v.follows.cache_dir)
                if plan is None:
                    continue  # the plan it follows is still undecided
                v.checkpointed = plan.recompute
                v.peak_bytes = _baseline_peak(start, v, data, c.train.batch_size)
            model = copy.deepcopy(start)
            v.first = r if v.first < 0 else v.first
            seed_everything(c.seed, c.train.torch_threads)
            begin = time.perf_counter()
            outcome = _round(v, model, data, replace(local, seed=c.seed + r))
            elapsed = time.perf_counter() - begin
            v.round_s.append(elapsed)
            v.outcomes.append(outcome)
            if reference is None:
                reference, reference_s = model, elapsed
            else:
                v.identical.append(_same(model, reference))
                v.ratios.append(elapsed / reference_s)
        print(f"#   round {r + 1} done", flush=True)
    variants[0].peak_bytes = peak.unmanaged_peak_bytes
    ran = [v for v in variants if v.round_s]
    rows = [_row(v, variants[0], peak.unmanaged_peak_bytes) for v in ran]
    for v in ran:
        if v.follows is not None:  # the class's main setting against the same modules' checkpoint
            main = next(r for r in rows if r["variant"] == v.follows.name)
            main["vs_checkpoint_same_paired"] = _paired(v.follows, v)
    return rows


def _paired(a: Variant, b: Variant) -> float | None:
    """Median over the rounds both ran, after ``a``'s first, of ``a``'s round over ``b``'s.

    Both ran in the same turn, one after the other: the ratio of the two is paired as each one's
    ratio to the unmanaged round is.
    """
    offset = b.first - a.first
    pairs = [
        x / y
        for i, (x, y) in enumerate(zip(a.round_s[offset:], b.round_s, strict=True))
        if offset + i > 0
    ]
    return statistics.median(pairs) if pairs else None


def _row(v: Variant, reference: Variant, peak_bytes: int) -> dict[str, Any]:
    skip = 1 if v.first == 0 else 0  # round 1 profiles (a baseline's first round does not)
    later = v.round_s[skip:] or v.round_s
    base = statistics.median(reference.round_s[1:] or reference.round_s)
    managed = v.settings is not None
    return {
        "variant": v.name,
        "budget_bytes": v.budget_bytes,
        "budget_fraction": None if v.budget_bytes is None else v.budget_bytes / peak_bytes,
        "checkpointed": None if v.checkpointed is None else list(v.checkpointed),
        "checkpointed_selectively": list(v.selective),
        "follows": None if v.follows is None else v.follows.name,
        "first_round": v.first + 1,
        "round_s_median": statistics.median(later),
        "round_s_all": v.round_s,
        "vs_unmanaged": statistics.median(later) / base,
        "paired_ratio_median": statistics.median(v.ratios[skip:] or v.ratios) if v.ratios else 1.0,
        "first_round_s": v.round_s[0],
        "mib_out_per_round": statistics.median(o.bytes_out for o in v.outcomes[skip:] or v.outcomes)
        / MIB,
        # Managed: the largest reading of its rounds; unmanaged ones: measured apart.
        "peak_bytes": max(o.peak_device_bytes for o in v.outcomes) if managed else v.peak_bytes,
        "plan_sources": [str(o.plan_source) for o in v.outcomes],
        "weights_identical": all(v.identical) if v.identical else True,
        "steps_per_round": v.outcomes[0].steps,
    }


def _summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per device class, its main-setting row against the fastest unmanaged way that fits."""
    lines = []
    plain = [r for r in rows if r["budget_bytes"] is None and r["peak_bytes"] is not None]
    for follower in (r for r in rows if r["follows"] is not None):
        main = next(r for r in rows if r["variant"] == follower["follows"])
        budget = main["budget_bytes"]
        fits = [r for r in plain if r["peak_bytes"] <= budget]
        listed = ", ".join(
            f"{r['variant']} ({r['peak_bytes'] / MIB:.1f} MiB, {r['paired_ratio_median']:.2f}x)"
            for r in fits
        )
        line = (
            f"# {main['variant']} at {budget / MIB:.1f} MiB: {main['paired_ratio_median']:.2f}x "
            f"unmanaged; fits the budget unmanaged: {listed or 'nothing'}"
        )
        if fits:
            best = min(fits, key=lambda r: r["round_s_median"])
            ratio = main["round_s_median"] / best["round_s_median"]
            line += f"; {ratio:.2f}x the fastest of them ({best['variant']})"
        same = main.get("vs_checkpoint_same_paired")
        if same is not None:
            modules = ", ".join(follower["checkpointed"] or []) or "none"
            line += f"; {same:.2f}x (paired) torch's checkpointing of its modules ({modules})"
        lines.append(line)
    return lines


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | budget MiB (%) | round s (median, rounds 2-N) | vs unmanaged | paired "
        "ratio | round 1 s | MiB out/round | tracked peak MiB | weights identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        budget = (
            "-"
            if r["budget_bytes"] is None
            else f"{r['budget_bytes'] / MIB:.1f} ({r['budget_fraction']:.0%})"
        )
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / MIB:.1f}"
        lines.append(
            f"| {r['variant']} | {budget} | {r['round_s_median']:.2f} | {r['vs_unmanaged']:.2f}x "
            f"| {r['paired_ratio_median']:.2f}x | {r['first_round_s']:.2f} | "
            f"{r['mib_out_per_round']:.1f} | {peak} | "
            f"{'yes' if r['weights_identical'] else 'NO'} |"
        )
    return "\n".join(lines)


def _mask_settings(chosen: list[str] | None) -> list[bool | str]:
    """The ``vtensor.encode_masks`` settings to run: false, then those ``--masks`` names."""
    if chosen is None:
        return [False]
    return [False, *({"true": True, "auto": "auto"}[c] for c in chosen or ["true"])]


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments, run, print the table, write the JSON lines."""
    own, overrides = split_overrides(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds per variant (default 7)")
    parser.add_argument(
        "--masks",
        nargs="*",
        choices=["true", "auto"],
        help="also each variant with clamps saving bits (vtensor.encode_masks=true), or with "
        "the plans deciding (auto); --masks alone: true",
    )
    parser.add_argument(
        "--max-examples", type=int, default=0, help="cap a round's examples (0: the client's all)"
    )
    add_quick(parser, "two rounds of 64 examples")
    add_out(parser)
    args = parser.parse_args(own)
    if args.quick:
        args.rounds, args.max_examples = 2, 64
    settings = load_run_settings(overrides)
    torch.set_num_threads(settings.client.train.torch_threads)  # as the clients train
    env = environment(script="main_round", overrides=overrides, rounds=args.rounds)
    print(describe(env), flush=True)
    started = time.perf_counter()
    rows = run(args, settings)
    print(_table(rows))
    print("\n".join(_summary(rows)))
    print(f"# total {time.perf_counter() - started:.0f} s", flush=True)
    if args.out:
        write_json_lines(args.out, env, tagged("main_round", rows))


if __name__ == "__main__":
    main()
