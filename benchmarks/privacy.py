"""Privacy on the main job: round time, accuracy and epsilon with DP and secure aggregation.

Runs the main job (``scripts/main.sh``'s federated simulation: 8 memory-limited clients on
MNIST) on Flower's simulation engine once per variant, with the same seeds: plain FedAvg,
central DP (fixed clipping on the clients), SecAgg+, and both. Reports the median round wall
time (rounds 2 and later; round 1 includes one-time costs), central accuracy after the last
round and epsilon at delta 1e-5.

Run from the repository root::

    python -m benchmarks.privacy --rounds 5 --out privacy.jsonl
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

VARIANTS = {
    "plain": [],
    "central_fixed": ["privacy=central_fixed"],
    "secagg_plus": ["secagg=secagg_plus"],
    "central_fixed + secagg_plus": ["privacy=central_fixed", "secagg=secagg_plus"],
}


def run(overrides: list[str], rounds: int, out_dir: Path) -> dict[str, Any]:
    """One simulation of the main job with ``overrides``; per-round figures."""
    settings = prepare(
        load_run_settings([*overrides, f"num_rounds={rounds}", f"output_dir={out_dir}"])
    )
    history: RunHistory = simulate(settings, peak=measure_peak(settings))["history"]
    rows = [
        {"round": r.server_round, "wall_s": r.wall_s, "acc": r.central_acc, "epsilon": r.epsilon}
        for r in history.rounds[1:]
    ]
    return {
        "rounds": rows,
        "median_wall_s": statistics.median(r.wall_s for r in history.rounds[2:]),
        "final_acc": rows[-1]["acc"],
        "epsilon": rows[-1]["epsilon"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    add_out(p)
    args = p.parse_args(argv)
    configure_logging()
    env = environment()
    print(describe(env))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(VARIANTS.items()):
            results[name] = run(overrides, args.rounds, Path(tmp) / str(i))
    base = results["plain"]["median_wall_s"]
    print("| variant | median round s (rounds 2+) | vs plain | central acc | epsilon |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.0f}"
        print(
            f"| {name} | {r['median_wall_s']:.2f} | {r['median_wall_s'] / base:.2f}x "
            f"| {r['final_acc']:.4f} | {eps} |"
        )
    rows = ({"variant": name, **r} for name, r in results.items())
    write_json_lines(args.out, env, tagged("variant", rows))


if __name__ == "__main__":
    main()
