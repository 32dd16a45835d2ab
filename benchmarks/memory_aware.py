"""Memory-aware pacing against plain FedAvg: round time and accuracy on a heterogeneous fleet.

Runs the same federated simulation twice with the same seeds, ``pacing=none`` and
``pacing=memory_aware`` (both over FedAvg), on the main job's fleet: 8 clients in 3 device
classes with budgets below the model's unmanaged training peak and Dirichlet-sized data shares.

Two round times are reported. ``fleet_round_s`` is the longest client's ``train-s`` of a round:
on a real fleet the devices train in parallel and the round lasts as long as its slowest one.
``wall_s`` is this machine's wall time of the round, where Flower's simulation engine runs the
clients a few at a time on its cores (so it follows their total work, not the slowest one).
Figures of round 1 (no telemetry yet: nothing is paced) are reported apart. Because both
times move with this machine's load, the script also reports a load-free figure:
``paced_fleet_ratio``, the slowest client's predicted time in a round (its examples times its
own seconds per example measured in round 1) over the same figure in round 1.

Run from the repository root (trailing arguments are Hydra overrides for both runs)::

    python -m benchmarks.memory_aware --rounds 5 --out results.jsonl
"""

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import add_out, describe, environment, tagged, write_json_lines
from edgefl.config import load_run_settings
from edgefl.history import RunHistory
from edgefl.log_setup import configure_logging
from edgefl.sim import measure_peak, prepare, simulate


def run(pacing: str, rounds: int, out_dir: Path, extra: list[str]) -> dict[str, Any]:
    """One simulation; per-round fleet time, wall time and central accuracy."""
    overrides = [f"pacing={pacing}", f"num_rounds={rounds}", f"output_dir={out_dir}", *extra]
    settings = prepare(load_run_settings(overrides))
    history: RunHistory = simulate(settings, peak=measure_peak(settings))["history"]
    rows = []
    speed: dict[int, float] = {}  # seconds per example of each client in round 1
    for record in history.rounds[1:]:
        trained = [
            c
            for c in history.clients
            if c.server_round == record.server_round and c.phase == "train" and c.error is None
        ]
        if not speed:
            speed = {
                c.node_id: c.metrics["train-s"] / c.metrics["examples-processed"] for c in trained
            }
        predicted = max(c.metrics["examples-processed"] * speed[c.node_id] for c in trained)
        rows.append(
            {
                "round": record.server_round,
                "fleet_round_s": max(c.metrics["train-s"] for c in trained),
                "predicted_fleet_s": predicted,
                "wall_s": record.wall_s,
                "examples": sum(c.metrics["examples-processed"] for c in trained),
                "central_acc": record.central_acc,
            }
        )
    return {"pacing": pacing, "rounds": rows}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians over the paced rounds (2..), round 1 apart, final accuracy."""
    later = result["rounds"][1:]
    return {
        "pacing": result["pacing"],
        "round1_fleet_s": result["rounds"][0]["fleet_round_s"],
        "median_fleet_round_s": statistics.median(r["fleet_round_s"] for r in later),
        "median_wall_s": statistics.median(r["wall_s"] for r in later),
        "paced_fleet_ratio": statistics.median(r["predicted_fleet_s"] for r in later)
        / result["rounds"][0]["predicted_fleet_s"],
        "examples_per_round": statistics.median(r["examples"] for r in later),
        "final_acc": result["rounds"][-1]["central_acc"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    add_out(p)
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for both runs")
    args = p.parse_args(argv)
    configure_logging()
    env = environment()
    print(describe(env))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for pacing in ("none", "memory_aware"):
            results.append(run(pacing, args.rounds, Path(tmp) / pacing, args.overrides))
    summaries = [summarize(r) for r in results]
    print(
        "| pacing | round 1 fleet s | median fleet round s (rounds 2+) | slowest client vs "
        "round 1 (load-free) | median wall s | examples/round | final acc |"
    )
    print("|---|---|---|---|---|---|---|")
    for s in summaries:
        print(
            f"| {s['pacing']} | {s['round1_fleet_s']:.2f} | {s['median_fleet_round_s']:.2f} "
            f"| {s['paced_fleet_ratio']:.2f} | {s['median_wall_s']:.2f} "
            f"| {s['examples_per_round']:.0f} | {s['final_acc']:.4f} |"
        )
    write_json_lines(args.out, env, [*tagged("run", results), *tagged("summary", summaries)])


if __name__ == "__main__":
    main()
