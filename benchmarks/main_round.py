"""The main job's local round under vtensor against the same round unmanaged, side by side.

What a client of the main job does each round, without the simulation engine between: client
0's data, the model and the local round from the main job's configuration (``conf/config.yaml``;
Hydra overrides after ``--``), trained in this one process unmanaged and under each device
class's budget, swap-only (``vtensor.recompute=false``) and with recomputation (the main job's
setting). The variants take turns round by round, each round from the same
starting weights, so every managed round is set against an unmanaged one run under the same
load. Round 1 of a variant profiles (with recomputation, also tries candidates and races them)
and fills the plan cache its class shares, as in a simulation; it is reported apart. Every later
round opens a fresh manager that loads the cached plan, as each round of a simulated client does.

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
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import (
    add_out,
    add_quick,
    describe,
    environment,
    tagged,
    write_json_lines,
)
from edgefl.client_data import client_split
from edgefl.config import load_run_settings
from edgefl.models import build_model
from edgefl.peak import measure_unmanaged_peak
from edgefl.settings import RunSettings, VTensorSettings
from edgefl.train import (
    LocalRound,
    TrainOutcome,
    seed_everything,
    settings_round,
    train_local,
    train_within_budget,
)

MIB = 1 << 20


@dataclass
class Variant:
    """One way to train the round: unmanaged, or under a device class's budget."""

    name: str
    budget_bytes: int | None = None
    settings: VTensorSettings | None = None
    cache_dir: Path | None = None
    round_s: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # against the same turn's unmanaged round
    outcomes: list[TrainOutcome] = field(default_factory=list)
    identical: list[bool] = field(default_factory=list)


def _round(v: Variant, model: nn.Module, data: Any, local: LocalRound) -> TrainOutcome:
    if v.settings is None:
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
    info, data, _ = client_split(c.data, c.data.root, 0, settings.server.num_supernodes, c.seed)
    seed_everything(c.seed, c.train.torch_threads)
    start = build_model(c.model.name, info, c.model.options)
    peak = measure_unmanaged_peak(copy.deepcopy(start), data, c.train.batch_size)
    local = settings_round(c.train, c.seed, args.max_examples)
    root = Path(tempfile.mkdtemp(prefix="main-round-"))
    variants = [Variant("unmanaged")]
    for device in c.fleet.classes:
        budget = device.budget.bytes or int(device.budget.peak_fraction * peak.unmanaged_peak_bytes)
        for recompute in (False, True):
            for masks in _mask_settings(args.masks):
                suffix = {True: "+masks", "auto": "+auto"}.get(masks, "")
                name = device.name + "+recompute" * recompute + suffix
                vt = replace(c.vtensor, enabled=True, recompute=recompute, encode_masks=masks)
                variants.append(Variant(name, budget, vt, root / name))
    print(
        f"# {c.model.name} on {c.data.name}, batch {c.train.batch_size}: unmanaged peak "
        f"{peak.unmanaged_peak_bytes / MIB:.1f} MiB, smallest workable budget "
        f"{peak.min_budget_bytes / MIB:.1f} MiB; {len(data)} examples a round",
        flush=True,
    )
    for r in range(args.rounds):
        reference: nn.Module | None = None
        reference_s = 0.0
        for v in variants:
            model = copy.deepcopy(start)
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
    return [_row(v, variants[0], peak.unmanaged_peak_bytes) for v in variants]


def _row(v: Variant, reference: Variant, peak_bytes: int) -> dict[str, Any]:
    later = v.round_s[1:] or v.round_s
    base = statistics.median(reference.round_s[1:] or reference.round_s)
    return {
        "variant": v.name,
        "budget_bytes": v.budget_bytes,
        "budget_fraction": None if v.budget_bytes is None else v.budget_bytes / peak_bytes,
        "round_s_median": statistics.median(later),
        "round_s_all": v.round_s,
        "vs_unmanaged": statistics.median(later) / base,
        "paired_ratio_median": statistics.median(v.ratios[1:] or v.ratios) if v.ratios else 1.0,
        "first_round_s": v.round_s[0],
        "mib_out_per_round": statistics.median(o.bytes_out for o in v.outcomes[1:] or v.outcomes)
        / MIB,
        "peak_bytes": max(o.peak_device_bytes for o in v.outcomes),
        "plan_sources": [str(o.plan_source) for o in v.outcomes],
        "weights_identical": all(v.identical) if v.identical else True,
        "steps_per_round": v.outcomes[0].steps,
    }


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
        peak = "-" if r["budget_bytes"] is None else f"{r['peak_bytes'] / MIB:.1f}"
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
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
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
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.max_examples = 2, 64
    settings = load_run_settings(overrides)
    torch.set_num_threads(settings.client.train.torch_threads)  # as the clients train
    env = environment(script="main_round", overrides=overrides, rounds=args.rounds)
    print(describe(env), flush=True)
    started = time.perf_counter()
    rows = run(args, settings)
    print(_table(rows))
    print(f"# total {time.perf_counter() - started:.0f} s", flush=True)
    if args.out:
        write_json_lines(args.out, env, tagged("main_round", rows))


if __name__ == "__main__":
    main()
