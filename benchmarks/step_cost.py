"""Where a managed step of the main job's model spends its time, phase by phase, against unmanaged.

The main job's model, client 0's data and batch size (``conf/config.yaml``; Hydra overrides after
``--``), trained in this one process unmanaged and under each device class's budget, swap-only, with
recomputation, and with recomputation and clamps saving their output (``+recompute+masks``, the main
job's setting), the variants taking turns round by round from the same weights. Every round opens a
fresh manager on the class's plan cache, as a round of the main job does; round 1 decides the plan
(NOTE [one decision] in ``vtensor/activations/plan/decision.py``) and is left out. Parameters are
offloaded where the main job's rule would (``offload_setting``). Each step is timed in five phases
with ``time.perf_counter``: entering ``mm.step`` (the plan key, the model's state, the hooks),
forward with the loss, backward, leaving ``mm.step`` (the report, the hooks off), and the
optimizer's update. Beside them, per class, unmanaged, ``torch.utils.checkpoint`` of exactly the
modules the main job's setting's plan recomputes (``checkpoint-<class>``, from the round after that
plan is decided; ``main_round`` does the same): what the manager adds to the forward and backward of
its recomputation is the difference. Per variant: the median of each phase over every step of rounds
2 to N (of a ``checkpoint-`` variant, of every round it ran), in milliseconds, the median round, and
the median MiB a step moves out. Run from the repository root::

    python -m benchmarks.step_cost --rounds 7 --out step_cost.jsonl
    python -m benchmarks.step_cost --quick    # CI-sized; its rows are not results
"""

import argparse
import contextlib
import copy
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

import vtensor
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
from benchmarks.main_round import checkpointed_modules, decided_plan
from edgefl.config import load_run_settings
from edgefl.settings import RunSettings
from edgefl.train import _batches, offload_setting, seed_everything

PHASES = ("enter", "forward", "backward", "exit", "update")


def run(args: argparse.Namespace, settings: RunSettings) -> list[dict[str, Any]]:
    """Every variant's rounds, interleaved; one row per variant."""
    c = settings.client
    data, start, peak = client_zero(settings)
    variants: list[tuple[str, int | None, bool, bool]] = [("unmanaged", None, False, False)]
    follows: dict[str, str] = {}  # checkpoint-<class>: the variant whose plan it checkpoints
    for device in c.fleet.classes:
        budget = device.budget.of_peak(peak.unmanaged_peak_bytes)
        variants += [
            (device.name, budget, False, False),
            (f"{device.name}+recompute", budget, True, False),
            (f"{device.name}+recompute+masks", budget, True, True),
            (f"checkpoint-{device.name}", None, False, False),
        ]
        follows[f"checkpoint-{device.name}"] = f"{device.name}+recompute+masks"
    if args.variants:
        unknown = set(args.variants) - {v[0] for v in variants}
        if unknown:
            raise SystemExit(
                f"unknown variants {sorted(unknown)}; choose from {[v[0] for v in variants]}"
            )
        variants = [v for v in variants if v[0] == "unmanaged" or v[0] in args.variants]
    root = Path(tempfile.mkdtemp(prefix="step-cost-"))
    times: dict[str, dict[str, list[float]]] = {v[0]: {p: [] for p in PHASES} for v in variants}
    rounds: dict[str, list[float]] = {v[0]: [] for v in variants}
    moved: dict[str, list[int]] = {v[0]: [] for v in variants}
    checkpointed: dict[str, tuple[str, ...]] = {}
    loss_fn = torch.nn.CrossEntropyLoss()
    # The main job's rule for its clients (plain SGD here: no proximal term).
    offload = offload_setting(replace(c.vtensor, enabled=True), 0.0)
    for r in range(args.rounds):
        for name, budget, recompute, masks in variants:
            model = copy.deepcopy(start)
            if name in follows:
                if name not in checkpointed:
                    plan = decided_plan(root / follows[name])
                    if plan is None:
                        continue  # the plan it follows is still undecided
                    checkpointed[name] = plan.recompute
                model = checkpointed_modules(model, checkpointed[name], ())
            seed_everything(c.seed, c.train.torch_threads)
            opt = torch.optim.SGD(model.parameters(), lr=c.train.lr, momentum=c.train.momentum)
            mm = None
            if budget is not None:
                mm = vtensor.MemoryManager(
                    budget,
                    chunk_bytes=c.vtensor.chunk_bytes,
                    plan_cache_dir=root / name,
                    recompute=recompute,
                    encode_masks=masks,
                    offload_params=offload,
                )
            rng = np.random.default_rng(c.seed + r)
            begun = time.perf_counter()
            for x, y in _batches(data, c.train.batch_size, 1, rng, args.max_examples):
                opt.zero_grad(set_to_none=True)
                marks = [time.perf_counter()]
                block = mm.step(model, opt, (x, y)) if mm else contextlib.nullcontext()
                block.__enter__()
                marks.append(time.perf_counter())
                loss = loss_fn(model(x), y)
                marks.append(time.perf_counter())
                loss.backward()  # type: ignore[no-untyped-call]
                marks.append(time.perf_counter())
                block.__exit__(None, None, None)
                marks.append(time.perf_counter())
                opt.step()
                marks.append(time.perf_counter())
                if r > 0 or name in follows:  # round 1 profiles; a baseline's does not
                    for phase, a, b in zip(PHASES, marks[:-1], marks[1:], strict=True):
                        times[name][phase].append((b - a) * 1e3)
                    moved[name].append(mm.report().bytes_out if mm else 0)
            if r > 0 or name in follows:
                rounds[name].append(time.perf_counter() - begun)
            if mm is not None:
                mm.close()
        print(f"#   round {r + 1} done", flush=True)
    return [
        {
            "variant": name,
            "budget_bytes": budget,
            **{f"{p}_ms": statistics.median(times[name][p]) for p in PHASES},
            "round_s_median": statistics.median(rounds[name]),
            "mib_out_per_step": statistics.median(moved[name]) / (1 << 20),
            "steps": len(times[name]["enter"]),
            "checkpointed": list(checkpointed[name]) if name in checkpointed else None,
        }
        for name, budget, _, _ in variants
        if rounds[name]
    ]


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | "
        + " | ".join(f"{p} ms" for p in PHASES)
        + " | round s | vs unmanaged | MiB out/step |",
        "|---|" + "---|" * (len(PHASES) + 3),
    ]
    base = rows[0]["round_s_median"]
    for r in rows:
        cells = " | ".join(f"{r[f'{p}_ms']:.2f}" for p in PHASES)
        name = r["variant"]
        if r["checkpointed"] is not None:
            name += f" ({', '.join(r['checkpointed']) or 'none'})"
        lines.append(
            f"| {name} | {cells} | {r['round_s_median']:.2f} | "
            f"{r['round_s_median'] / base:.2f}x | {r['mib_out_per_step']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments, run, print the table, write the JSON lines."""
    own, overrides = split_overrides(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds per variant (default 7)")
    parser.add_argument(
        "--max-examples", type=int, default=0, help="cap a round's examples (0: the client's all)"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[],
        help="managed variants to run beside unmanaged, e.g. medium+recompute (default: all)",
    )
    add_quick(parser, "two rounds of 64 examples")
    add_out(parser)
    args = parser.parse_args(own)
    if args.quick:
        args.rounds, args.max_examples = 2, 64
    settings = load_run_settings(overrides)
    torch.set_num_threads(settings.client.train.torch_threads)  # as the clients train
    env = environment(script="step_cost", overrides=overrides, rounds=args.rounds)
    print(describe(env), flush=True)
    rows = run(args, settings)
    print(_table(rows))
    if args.out:
        write_json_lines(args.out, env, tagged("step_cost", rows))


if __name__ == "__main__":
    main()
