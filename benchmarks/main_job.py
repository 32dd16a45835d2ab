"""The main job itself with vtensor on and off, side by side: each federated round's wall time.

``scripts/main.sh`` runs the main job: Flower's simulation engine, 8 clients in three device
classes, each training under its class's budget with vtensor (the configuration in
``conf/config.yaml``, Hydra overrides after ``--``). This script runs that same simulation with
vtensor on (the main job's settings) and with vtensor off (``vtensor=disabled``: every client
trains unmanaged, as a fleet with ample memory would), ``--pairs`` times each, alternating
(on, off, off, on, ...), each in a fresh process as a user's run is: Ray's start, the data, the
peak measurement and the reference round, and for vtensor an empty plan cache, so round 1
decides each class's plan (NOTE [one decision] in ``vtensor/activations/plan/decision.py``:
profile, maybe a reprofile, a validating replay). Each pair then runs vtensor on once more
(``cached``) on the plan cache the pair's ``on`` run left: what a device that decided its plans
in an earlier run pays, as a deployed node keeps them in its ``--plan-cache``.

Both variants run the clients two at a time on the machine's two cores: the same load, which
the per-class table of a single run cannot give (its reference round is timed alone, NOTE
[reference round] in ``edgefl/reference.py``). A client round of vtensor whose plan came from
its class's plan cache (plan source ``cached``) ran the decided plan; the others profiled or
replayed a plan being decided (round 1, and round 2 where a class's decision went on).

Per round: the round's wall time as the ServerApp measures it (from sending the training
instructions to the evaluated global model), the median over each variant's runs, its ratio,
each pair's ratio (on and cached against the same pair's off run), and the plan sources of the
vtensor-on runs' client rounds (profiled, planned, cached, ...); round 1 apart (the plan
decisions), rounds 2 to N together, and the whole run. Per device class: the clients' local
training time per round (``train-s``), rounds 2 to N and round 1.
Bit-identity: the central accuracy and loss of every round must be equal in every run (training
under vtensor is bit-identical to training without it).

Run from the repository root::

    python -m benchmarks.main_job --pairs 3 --out main_job.jsonl   # about 15 minutes
    python -m benchmarks.main_job --quick    # one pair of two rounds; its rows are not results
"""

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    add_out,
    add_quick,
    describe,
    environment,
    split_overrides,
    tagged,
    write_json_lines,
)
from edgefl.config import load_run_settings

# "cached": vtensor on, with the plan cache an "on" run of the same pair left (a device that
# decided its plans in an earlier run, as a deployed node keeps them in its --plan-cache).
VARIANTS = {"on": [], "off": ["vtensor=disabled"], "cached": []}


@dataclass(frozen=True)
class ClientRound:
    """One client's local round: its device class (name), round, plan source, train time."""

    device_class: str
    server_round: int
    plan_source: str
    train_s: float


@dataclass
class Run:
    """One simulation: per round its wall time and central metrics, per client round its time."""

    variant: str
    pair: int
    wall_s: list[float]  # round 1 first
    central: list[tuple[float, float]]  # (accuracy, loss) per round
    clients: list[ClientRound] = field(default_factory=list)

    def train_s(self, device_class: str, rounds: Callable[[int], bool]) -> list[float]:
        """The train times of ``device_class``'s client rounds in the rounds ``rounds`` takes."""
        return [
            c.train_s
            for c in self.clients
            if c.device_class == device_class and rounds(c.server_round)
        ]

    def decided_s(self, device_class: str) -> list[float]:
        """The class's client rounds on a plan loaded from its cache (the decided plan)."""
        return [
            c.train_s
            for c in self.clients
            if c.device_class == device_class and c.plan_source == "cached"
        ]


def simulate(
    variant: str, pair: int, overrides: Sequence[str], out_dir: Path, plan_cache: Path | None = None
) -> Run:
    """Run the main job once in a fresh process; read its rounds and clients back.

    ``plan_cache``: the clients' plan-cache root (default: a fresh one under ``out_dir``).
    """
    cache = [f"fleet.plan_cache_root={plan_cache}"] if plan_cache is not None else []
    command = [
        sys.executable,
        "-m",
        "edgefl.sim",
        *VARIANTS[variant],
        *overrides,
        *cache,
        f"output_dir={out_dir}",
        "server.save_plots=false",
    ]
    log = out_dir.with_suffix(".log")
    with open(log, "w") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = log.read_text().splitlines()[-20:]
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n" + "\n".join(tail))
    recorded = json.loads((out_dir / "rounds.json").read_text())["rounds"]
    rounds = [r for r in recorded if r["server_round"] > 0]  # round 0: the initial evaluation
    run = Run(
        variant,
        pair,
        [r["wall_s"] for r in rounds],
        [(r["central_acc"], r["central_loss"]) for r in rounds],
    )
    with open(out_dir / "clients.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row["phase"] == "train" and not row["error"]:
                run.clients.append(
                    ClientRound(
                        row["device-class"],
                        int(row["server_round"]),
                        row["plan-source"],
                        float(row["train-s"]),
                    )
                )
    return run


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _round_rows(runs: list[Run]) -> list[dict[str, Any]]:
    """Per round (and rounds 2-N, and the whole run): the median wall time of each variant.

    Also each pair's ratios (on and cached against the same pair's off run), and the plan
    sources of the on runs' client rounds.
    """
    n = len(runs[0].wall_s)
    rows = []
    spans = [(f"{i + 1}", [i]) for i in range(n)]
    spans += [(f"2-{n}", list(range(1, n))), (f"1-{n}", list(range(n)))] if n > 1 else []
    for name, rounds in spans:
        row: dict[str, Any] = {"rounds": name}
        wall = {(r.variant, r.pair): sum(r.wall_s[i] for i in rounds) for r in runs}
        for variant in VARIANTS:
            each = [s for (v, _), s in wall.items() if v == variant]
            row[f"{variant}_s"], row[f"{variant}_all"] = _median(each), each
        row["ratio"] = row["on_s"] / row["off_s"]
        row["cached_ratio"] = row["cached_s"] / row["off_s"]
        pairs = sorted({r.pair for r in runs})
        row["pair_ratios"] = [wall["on", p] / wall["off", p] for p in pairs]
        row["pair_cached_ratios"] = [wall["cached", p] / wall["off", p] for p in pairs]
        numbers = {i + 1 for i in rounds}
        sources = Counter(
            c.plan_source
            for r in runs
            if r.variant == "on"
            for c in r.clients
            if c.server_round in numbers
        )
        row["on_plan_sources"] = dict(sorted(sources.items()))
        rows.append(row)
    return rows


def _class_rows(
    runs: list[Run], names: Sequence[str], budgets: Sequence[str]
) -> list[dict[str, Any]]:
    """Per device class: the median of its clients' local training time per round."""
    rows = []
    for index, name in enumerate(names):
        row: dict[str, Any] = {"device_class": name, "budget": budgets[index]}
        for variant in VARIANTS:
            mine = [r for r in runs if r.variant == variant]
            first = [s for r in mine for s in r.train_s(name, lambda n: n == 1)]
            later = [s for r in mine for s in r.train_s(name, lambda n: n > 1)]
            row[f"{variant}_round1_s"] = _median(first)
            row[f"{variant}_later_s"] = _median(later)
        decided = [s for r in runs if r.variant == "on" for s in r.decided_s(name)]
        row["on_decided_s"], row["on_decided_rounds"] = _median(decided), len(decided)
        row["decided_ratio"] = row["on_decided_s"] / row["off_later_s"]
        row["later_ratio"] = row["on_later_s"] / row["off_later_s"]
        row["round1_ratio"] = row["on_round1_s"] / row["off_round1_s"]
        row["cached_round1_ratio"] = row["cached_round1_s"] / row["off_round1_s"]
        rows.append(row)
    return rows


def _identical(runs: list[Run]) -> bool:
    """Whether every run's central accuracy and loss agree, round by round."""
    return all(r.central == runs[0].central for r in runs)


def run_pairs(args: argparse.Namespace, overrides: list[str]) -> list[Run]:
    """``args.pairs`` runs of each variant: on and off alternating (on, off, off, on, ...), then
    ``cached`` on the plan cache the pair's ``on`` run left."""
    root = Path(tempfile.mkdtemp(prefix="main-job-"))
    runs = []
    for pair in range(args.pairs):
        for variant in ("on", "off", "cached") if pair % 2 == 0 else ("off", "on", "cached"):
            out_dir = root / f"{pair}-{variant}"
            cache = root / f"{pair}-on" / "plan-cache" if variant == "cached" else None
            run = simulate(variant, pair, overrides, out_dir, cache)
            runs.append(run)
            walls = ", ".join(f"{s:.1f}" for s in run.wall_s)
            print(f"#   pair {pair + 1}, vtensor {variant}: rounds {walls} s", flush=True)
    return runs


def _tables(round_rows: list[dict[str, Any]], class_rows: list[dict[str, Any]]) -> str:
    def each(ratios: list[float]) -> str:
        return ", ".join(f"{x:.2f}x" for x in ratios)

    lines = [
        "| rounds | vtensor on, s | vtensor off, s | on / off | pair by pair "
        "| on, plans cached, s | / off | pair by pair | plan sources, on (client rounds) |",
        "|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['rounds']} | {r['on_s']:.1f} | {r['off_s']:.1f} | {r['ratio']:.2f}x | "
            f"{each(r['pair_ratios'])} | {r['cached_s']:.1f} | {r['cached_ratio']:.2f}x | "
            f"{each(r['pair_cached_ratios'])} | "
            f"{', '.join(f'{k} {v}' for k, v in r['on_plan_sources'].items())} |"
            for r in round_rows
        ),
        "",
        "| device class (budget) | train s a round, rounds 2-N: on | off | on / off "
        "| on, plan decided (client rounds) | / off | round 1: on | off | on / off "
        "| round 1, plans cached | / off |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['device_class']} ({r['budget']}) | {r['on_later_s']:.2f} | "
            f"{r['off_later_s']:.2f} | {r['later_ratio']:.2f}x | {r['on_decided_s']:.2f} "
            f"({r['on_decided_rounds']}) | {r['decided_ratio']:.2f}x | {r['on_round1_s']:.2f} | "
            f"{r['off_round1_s']:.2f} | {r['round1_ratio']:.2f}x | {r['cached_round1_s']:.2f} | "
            f"{r['cached_round1_ratio']:.2f}x |"
            for r in class_rows
        ),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments, run the pairs, print the tables, write the JSON lines."""
    own, overrides = split_overrides(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pairs", type=int, default=3, help="runs of each variant, alternating (default 3)"
    )
    add_quick(parser, "one pair of two rounds")
    add_out(parser)
    args = parser.parse_args(own)
    if args.quick:
        args.pairs = 1
        overrides = ["num_rounds=2", *overrides]
    settings = load_run_settings(overrides)
    torch.set_num_threads(settings.client.train.torch_threads)  # recorded as the clients train
    classes = settings.client.fleet.classes
    env = environment(script="main_job", overrides=overrides, pairs=args.pairs)
    print(describe(env), flush=True)
    started = time.perf_counter()
    runs = run_pairs(args, overrides)
    round_rows = _round_rows(runs)
    budgets = [str(c.budget) for c in classes]
    class_rows = _class_rows(runs, [c.name for c in classes], budgets)
    same = _identical(runs)
    print(_tables(round_rows, class_rows))
    print(
        f"# central accuracy and loss identical in every run, every round: "
        f"{'yes' if same else 'NO'}"
    )
    print(f"# total {time.perf_counter() - started:.0f} s", flush=True)
    summary = {"identical": same, "central": runs[0].central}
    rows = [*tagged("round", round_rows), *tagged("device_class", class_rows)]
    write_json_lines(args.out, env, [*rows, *tagged("summary", [summary])])


if __name__ == "__main__":
    main()
