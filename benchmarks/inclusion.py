"""Inclusion: what a fleet with devices too small for the model gets from each way to include them.

One fleet, one split, the same seeds, four variants on Flower's simulation engine:

- ``fits_only``: FedAvg over the clients whose budget holds the model's unmanaged training
  peak; the memory-starved clients reply with a budget error and take no part
  (``strategy=fits_only``: HeteroFL with the one width ratio 1);
- ``heterofl``: the starved clients train the widest width-scaled sub-model whose measured
  unmanaged peak fits their budget, averaged on the overlapping slices (``strategy=heterofl``);
- ``edgefl``: every client trains the full model under its budget with vtensor (FedAvg);
- ``ample``: the same fleet with ample memory, unmanaged (FedAvg, vtensor off); ``edgefl``'s
  global model must equal it bit for bit.

The split correlates the device class with the data: ``partitioner=label_split`` deals every
MNIST training image of digits 0, 1 and 2 to the starved clients (the first ``--starved``
client ids, the starved class) and the other digits to the rest, so those digits are held by
starved clients only. The model is the small CNN (``model=cnn``, width 16, 2 convs per
stage). Per round: central accuracy, accuracy
on the test images of those digits, and the round's wall time on this machine.

Run from the repository root::

    python -m benchmarks.inclusion --out inclusion.jsonl
"""

import argparse
import dataclasses
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import MessageType

from benchmarks.common import add_out, describe, environment, tagged, write_json_lines
from edgefl.budget import Budget
from edgefl.client_data import client_split
from edgefl.config import load_run_settings
from edgefl.data import ArrayDataset, load_dataset
from edgefl.fleet import device_class_for
from edgefl.log_setup import configure_logging
from edgefl.models import build_model
from edgefl.recording_grid import Exchange
from edgefl.settings import DeviceClass, RunSettings
from edgefl.sim import measure_peak, prepare, simulate
from edgefl.submodel import scaled_options, slice_to_shapes
from edgefl.train import evaluate
from strategies.heterofl import WIDTH_RATIO

STARVED, AMPLE = "starved", "ample"
AMPLE_BUDGET = Budget(1 << 30)
COMMON = [
    "model=cnn",  # width-scaled sub-models exist for the cnn (edgefl/submodel.py)
    "partitioner=label_split",  # the starved clients alone hold partitioner.labels (0, 1, 2)
    "pacing=none",
    # Plain SGD: with the main job's momentum 0.9 (lr 0.05 or 0.01) FedAvg over this split
    # oscillates between the two label groups (benchmarks/README.md); every variant the same.
    "train.lr=0.02",
    "train.momentum=0.0",
    "server.checkpoint=false",
    "server.save_plots=false",
]
VARIANTS: dict[str, list[str]] = {
    "fits_only": ["strategy=fits_only", "vtensor=disabled"],
    "heterofl": ["strategy=heterofl", "vtensor=disabled"],
    "edgefl": ["strategy=fedavg", "vtensor=enabled"],
    "ample": ["strategy=fedavg", "vtensor=disabled"],
}


def settings_for(variant: str, args: argparse.Namespace, out_dir: Path) -> RunSettings:
    """The variant's settings: the shared fleet (starved at ``--budget`` except for ``ample``)."""
    overrides = [
        *COMMON,
        *VARIANTS[variant],
        f"num_rounds={args.rounds}",
        f"num_supernodes={args.clients}",
        f"partitioner.partitions={args.starved}",
        f"output_dir={out_dir}",
        *args.overrides,
    ]
    s = load_run_settings(overrides)
    starved = AMPLE_BUDGET if variant == "ample" else Budget(peak_fraction=args.budget)
    share = args.starved / args.clients
    classes = (DeviceClass(STARVED, starved, share), DeviceClass(AMPLE, AMPLE_BUDGET, 1 - share))
    fleet = dataclasses.replace(s.client.fleet, classes=classes)
    return prepare(dataclasses.replace(s, client=dataclasses.replace(s.client, fleet=fleet)))


def starved_only_test(s: RunSettings) -> tuple[list[int], ArrayDataset]:
    """The labels only starved clients hold, and the test images of those labels."""
    c, num = s.client, s.server.num_supernodes
    held: dict[str, set[int]] = {STARVED: set(), AMPLE: set()}
    for pid in range(num):
        _, device = device_class_for(c.fleet, pid, num)
        _, train, _ = client_split(c.data, c.data.root, pid, num, c.seed)
        held[device.name] |= {int(y) for y in np.unique(train.y)}
    labels = sorted(held[STARVED] - held[AMPLE])
    test = load_dataset(c.data.name, c.data.root, c.data.seq_len).test
    return labels, test.subset(np.flatnonzero(np.isin(test.y, labels)))


def run(variant: str, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """One simulation; per-round rows, the final model and the clients' width ratios."""
    s = settings_for(variant, args, out_dir)
    models: dict[int, dict[str, torch.Tensor]] = {}

    def keep_global(exchange: Exchange) -> None:  # evaluate instructions carry the global model
        if exchange.message_type == MessageType.EVALUATE:
            (arrays,) = exchange.sent[0].content.array_records.values()
            models[exchange.server_round] = arrays.to_torch_state_dict()

    peak = measure_peak(s)
    outcome = simulate(s, [keep_global], peak=peak)
    history = outcome["history"]
    labels, test = starved_only_test(s)
    info = load_dataset(s.client.data.name, s.client.data.root, s.client.data.seq_len).info
    model = build_model(s.client.model.name, info, s.client.model.options)
    rows = []
    for record in history.rounds[1:]:
        model.load_state_dict(models[record.server_round])
        trained = [
            c.metrics
            for c in history.clients
            if c.server_round == record.server_round and c.phase == "train" and c.error is None
        ]
        narrowest = min(m.get(WIDTH_RATIO, 1.0) for m in trained)
        rows.append(
            {
                "round": record.server_round,
                "central_acc": record.central_acc,
                "starved_only_acc": evaluate(model, test, 512).accuracy,
                # HeteroFL: the narrowest sub-model cut from the global model, as its devices run it
                "starved_only_acc_submodel": _submodel_acc(
                    s, info, models[record.server_round], narrowest, test
                )
                if narrowest < 1.0
                else None,
                "wall_s": record.wall_s,
                "fleet_round_s": max(m["train-s"] for m in trained),
                "clients_trained": record.clients_trained,
                "clients_failed": record.clients_failed,
                "bytes_swapped": record.bytes_swapped,
                "max_peak_fraction": record.max_peak_fraction,
                "width_ratios": sorted(m.get(WIDTH_RATIO, 1.0) for m in trained),
            }
        )
    return {
        "variant": variant,
        "unmanaged_peak_bytes": peak.unmanaged_peak_bytes,
        "min_budget_bytes": peak.min_budget_bytes,
        "starved_budget_fraction": args.budget if variant != "ample" else None,
        "starved_only_labels": labels,
        "starved_only_test_images": len(test),
        "rounds": rows,
        "final_state": outcome["final_state"],
    }


def _submodel_acc(
    s: RunSettings,
    info: Any,
    state: dict[str, torch.Tensor],
    ratio: float,
    test: ArrayDataset,
) -> float:
    """Accuracy on ``test`` of the width-``ratio`` sub-model sliced from the global ``state``."""
    sub = build_model(
        s.client.model.name,
        info,
        scaled_options(s.client.model.name, s.client.model.options, ratio),
    )
    shapes = {k: tuple(v.shape) for k, v in sub.state_dict().items()}
    sliced = slice_to_shapes({k: v.numpy() for k, v in state.items()}, shapes)
    sub.load_state_dict({k: torch.from_numpy(v) for k, v in sliced.items()})
    return evaluate(sub, test, 512).accuracy


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Final accuracies, median wall and fleet round time of rounds 2.. (round 1 profiles)."""
    rounds = result["rounds"]
    later = rounds[1:] or rounds
    return {
        "variant": result["variant"],
        "final_central_acc": rounds[-1]["central_acc"],
        "final_starved_only_acc": rounds[-1]["starved_only_acc"],
        "final_starved_only_acc_submodel": rounds[-1]["starved_only_acc_submodel"],
        "median_wall_s": statistics.median(r["wall_s"] for r in later),
        "median_fleet_round_s": statistics.median(r["fleet_round_s"] for r in later),
        "clients_trained": rounds[-1]["clients_trained"],
        "width_ratios": rounds[-1]["width_ratios"],
        "bytes_swapped_per_round": statistics.median(r["bytes_swapped"] for r in later),
    }


def bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two state dicts have the same keys and equal tensors, bit for bit."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def checks(
    results: Sequence[dict[str, Any]], summaries: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """The issue's targets: edgefl vs fits-only (+10 points) and HeteroFL, ample bit-identity."""
    by = {s["variant"]: s for s in summaries}
    state = {r["variant"]: r["final_state"] for r in results}
    c, a, b, d = by["edgefl"], by["fits_only"], by["heterofl"], by["ample"]
    return {
        "edgefl_equals_ample_bit_for_bit": bit_identical(state["edgefl"], state["ample"]),
        "edgefl_minus_fits_only_points": 100 * (c["final_central_acc"] - a["final_central_acc"]),
        "edgefl_minus_heterofl_points": 100 * (c["final_central_acc"] - b["final_central_acc"]),
        "wall_edgefl_over_fits_only": c["median_wall_s"] / a["median_wall_s"],
        "wall_edgefl_over_ample": c["median_wall_s"] / d["median_wall_s"],
        "fleet_edgefl_over_fits_only": c["median_fleet_round_s"] / a["median_fleet_round_s"],
        "fleet_edgefl_over_ample": c["median_fleet_round_s"] / d["median_fleet_round_s"],
    }


def _print_tables(results: Sequence[dict[str, Any]], check: dict[str, Any]) -> None:
    first = results[0]
    print(
        f"# unmanaged peak {first['unmanaged_peak_bytes'] / 2**20:.2f} MiB, smallest workable "
        f"budget {first['min_budget_bytes'] / 2**20:.2f} MiB; labels only starved clients hold: "
        f"{first['starved_only_labels']} ({first['starved_only_test_images']} test images)"
    )
    print(
        "| variant | round | central acc | starved-only acc | starved-only acc, sub-model "
        "| wall s | fleet s | trained | failed | width ratios | swapped MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for row in r["rounds"]:
            ratios = ",".join(f"{x:g}" for x in row["width_ratios"])
            sub = row["starved_only_acc_submodel"]
            print(
                f"| {r['variant']} | {row['round']} | {row['central_acc']:.4f} "
                f"| {row['starved_only_acc']:.4f} | {'-' if sub is None else f'{sub:.4f}'} "
                f"| {row['wall_s']:.1f} "
                f"| {row['fleet_round_s']:.2f} | {row['clients_trained']} "
                f"| {row['clients_failed']} | {ratios} | {row['bytes_swapped'] / 2**20:.0f} |"
            )
    for key, value in check.items():
        print(f"# {key}: {value:.3f}" if isinstance(value, float) else f"# {key}: {value}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--starved", type=int, default=2, help="memory-starved clients (the first)")
    p.add_argument("--budget", type=float, default=0.8, help="starved budget / unmanaged peak")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    add_out(p)
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every variant")
    args = p.parse_args(argv)
    configure_logging()
    torch.set_num_threads(1)
    env = environment()
    print(describe(env))
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(v, args, Path(tmp) / v) for v in args.variants]
    summaries = [summarize(r) for r in results]
    check = checks(results, summaries) if len(results) == len(VARIANTS) else {}
    _print_tables(results, check)
    rows = [{k: v for k, v in r.items() if k != "final_state"} for r in results]
    write_json_lines(
        args.out,
        env,
        [*tagged("run", rows), *tagged("summary", summaries), *tagged("check", [check])],
    )


if __name__ == "__main__":
    main()
