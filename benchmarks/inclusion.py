"""Inclusion: devices below the model's training state, and what each way to include them gets.

The main job's model and training (the MLP, 4 x 1,024 units; MNIST; batch 64, SGD with momentum
0.9; one epoch a round, on at most 3,072 examples a client: half the main job's, so that five
variants of five rounds take a few minutes) on one fleet, one split, the same seeds, five
variants on Flower's simulation engine:

- ``fits_only``: (a) FedAvg over the clients whose budget holds the model's unmanaged training
  peak; the starved clients reply with a budget error and take no part
  (``strategy=fits_only``: HeteroFL with the one width ratio 1);
- ``heterofl``: (b) the starved clients train the widest width-scaled sub-model (HeteroFL's
  ratios 1, 1/2, 1/4, 1/8 of every hidden layer) whose measured unmanaged peak fits their
  budget, averaged on the overlapping slices (``strategy=heterofl``);
- ``local_tricks``: (c) each client trains the full model unmanaged as a user would without
  vtensor: as is where its budget holds the unmanaged peak, else at the largest smaller batch
  (or as many micro-batches accumulated) whose measured peak fits, else not at all. The
  decision per class comes from the measured floors (NOTE [without vtensor] in
  ``edgefl/summary.py``); a client none fits is dropped, as it would be in practice. The
  client app sets one batch size for the fleet, so a budget where only a smaller batch fits is
  refused (``local_tricks_plan``); below the training state and at the peak it runs;
- ``edgefl``: (d) every client trains the full model under its budget with vtensor (FedAvg);
- ``ample``: (e) the same fleet with ample memory, unmanaged (FedAvg, vtensor off); ``edgefl``'s
  global model must equal it bit for bit.

The fleet: ``--clients`` (8, the main job's) of which the first ``--starved`` (3) have
``--budget`` (0.6: the main job's micro class, 60 % of the unmanaged peak) and the others 128
MiB (the main job's medium class). The starved budget lies below the model's parameters +
gradients + momentum, where no batch size, micro-batching or checkpointing trains it. The
split correlates the device class with the data: ``partitioner=label_split`` deals every MNIST
training image of digits 0, 1 and 2 to the starved clients and the other digits to the rest, so
those digits are held by starved clients only. Per round: central accuracy, accuracy on the
test images of those digits, and the round's wall time on this machine.

Run from the repository root::

    python -m benchmarks.inclusion --out inclusion.jsonl
    python -m benchmarks.inclusion --rounds 2 --variants fits_only edgefl   # a quick check
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
from torch import nn

from benchmarks.common import add_out, describe, environment, tagged, write_json_lines
from edgefl.budget import Budget
from edgefl.client_data import client_split
from edgefl.config import load_run_settings
from edgefl.data import ArrayDataset, load_dataset
from edgefl.fleet import device_class_for
from edgefl.log_setup import configure_logging
from edgefl.models import build_model
from edgefl.peak import PeakMeasurement
from edgefl.recording_grid import Exchange
from edgefl.reference import ReferenceRound
from edgefl.settings import DeviceClass, RunSettings
from edgefl.sim import measure_peak, prepare, simulate, time_reference
from edgefl.submodel import scaled_options, slice_to_shapes
from edgefl.summary import without_vtensor
from edgefl.train import evaluate
from strategies.heterofl import WIDTH_RATIO

STARVED, AMPLE = "starved", "ample"
AMPLE_BUDGET = Budget(128 << 20)  # the main job's medium class: holds the unmanaged peak
COMMON = [
    "partitioner=label_split",  # the starved clients alone hold partitioner.labels (0, 1, 2)
    # Half the main job's 6,144: five variants of five rounds in a few minutes.
    "dataset.max_examples_per_client=3072",
    "pacing=none",
    "server.checkpoint=false",
    "server.save_plots=false",
]
VARIANTS: dict[str, list[str]] = {
    "fits_only": ["strategy=fits_only", "vtensor=disabled"],
    "heterofl": ["strategy=heterofl", "vtensor=disabled"],
    # Realized by fits_only's strategy once local_tricks_plan has found that every class
    # either fits as is or is dropped (it refuses a fleet where a smaller batch would do).
    "local_tricks": ["strategy=fits_only", "vtensor=disabled"],
    "edgefl": ["strategy=fedavg", "vtensor=enabled"],
    "ample": ["strategy=fedavg", "vtensor=disabled"],
}
LABELS = {
    "fits_only": "(a) fits-only FedAvg",
    "heterofl": "(b) HeteroFL",
    "local_tricks": "(c) local tricks",
    "edgefl": "(d) edgefl",
    "ample": "(e) ample memory",
}
AS_IS, DROPPED = "fits as is", "could not train"


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


def local_tricks_plan(classes: Sequence[DeviceClass], floors: PeakMeasurement) -> dict[str, str]:
    """Per device class, what trains it without vtensor (``without_vtensor`` of its budget).

    Raises:
        ValueError: a class would train at a smaller batch or with micro-batching; the client
            app sets one batch size for the fleet, so this variant cannot run it.
    """
    plan = {}
    for device in classes:
        decision = without_vtensor(device.budget.of_peak(floors.unmanaged_peak_bytes), floors)
        if decision != AS_IS and not decision.startswith(DROPPED):
            raise ValueError(
                f"device class {device.name}: without vtensor it would train with {decision}, "
                "which the client app cannot set per class; choose --budget below the training "
                "state or at least the unmanaged peak"
            )
        plan[device.name] = decision
    return plan


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


def run(
    variant: str, args: argparse.Namespace, out_dir: Path, reference: ReferenceRound
) -> dict[str, Any]:
    """One simulation; per-round rows, the final model and the clients' width ratios.

    ``reference`` is the unmanaged round of the end table, the same for every variant: timed
    once, not once per variant.
    """
    s = settings_for(variant, args, out_dir)
    models: dict[int, dict[str, torch.Tensor]] = {}

    def keep_global(exchange: Exchange) -> None:  # evaluate instructions carry the global model
        if exchange.message_type == MessageType.EVALUATE:
            (arrays,) = exchange.sent[0].content.array_records.values()
            models[exchange.server_round] = arrays.to_torch_state_dict()

    peak = measure_peak(s)
    plan = local_tricks_plan(s.client.fleet.classes, peak) if variant == "local_tricks" else {}
    outcome = simulate(s, [keep_global], peak=peak, reference=reference)
    labels, test = starved_only_test(s)
    dataset = load_dataset(s.client.data.name, s.client.data.root, s.client.data.seq_len)
    info = dataset.info
    model = build_model(s.client.model.name, info, s.client.model.options)
    rows = []
    for record in outcome["history"].rounds[1:]:
        model.load_state_dict(models[record.server_round])
        trained = [
            c.metrics
            for c in outcome["history"].clients
            if c.server_round == record.server_round and c.phase == "train" and c.error is None
        ]
        narrowest = min((m.get(WIDTH_RATIO, 1.0) for m in trained), default=1.0)
        # HeteroFL: the narrowest sub-model cut from the global model, as its devices run it
        sub = _submodel(s, info, models[record.server_round], narrowest)
        rows.append(
            {
                "round": record.server_round,
                "central_acc": record.central_acc,
                "starved_only_acc": evaluate(model, test, 512).accuracy,
                "central_acc_submodel": _accuracy(sub, dataset.test),
                "starved_only_acc_submodel": _accuracy(sub, test),
                "wall_s": record.wall_s,
                "fleet_round_s": max((m["train-s"] for m in trained), default=0.0),
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
        "state_bytes": peak.state_bytes,
        "min_budget_bytes": peak.min_budget_bytes,
        "starved_budget_bytes": s.client.fleet.classes[0].budget.of_peak(peak.unmanaged_peak_bytes),
        "local_tricks_plan": plan,
        "starved_only_labels": labels,
        "starved_only_test_images": len(test),
        "rounds": rows,
        "final_state": outcome["final_state"],
    }


def _submodel(
    s: RunSettings, info: Any, state: dict[str, torch.Tensor], ratio: float
) -> nn.Module | None:
    """The width-``ratio`` sub-model sliced from the global ``state``; None at ratio 1."""
    if ratio >= 1.0:
        return None
    model, options = s.client.model.name, s.client.model.options
    sub = build_model(model, info, scaled_options(model, options, ratio))
    shapes = {k: tuple(v.shape) for k, v in sub.state_dict().items()}
    sliced = slice_to_shapes({k: v.numpy() for k, v in state.items()}, shapes)
    sub.load_state_dict({k: torch.from_numpy(v) for k, v in sliced.items()})
    return sub


def _accuracy(model: nn.Module | None, data: ArrayDataset) -> float | None:
    return None if model is None else evaluate(model, data, 512).accuracy


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Final accuracies, median wall and fleet round time of rounds 2.. (round 1 decides plans)."""
    rounds = result["rounds"]
    later = rounds[1:] or rounds
    return {
        "variant": result["variant"],
        "final_central_acc": rounds[-1]["central_acc"],
        "final_starved_only_acc": rounds[-1]["starved_only_acc"],
        "final_starved_only_acc_submodel": rounds[-1]["starved_only_acc_submodel"],
        "final_central_acc_submodel": rounds[-1]["central_acc_submodel"],
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
    """The targets that the variants run allow: edgefl against each other one."""
    by = {s["variant"]: s for s in summaries}
    state = {r["variant"]: r["final_state"] for r in results}
    if "edgefl" not in by:
        return {}
    d = by["edgefl"]
    out: dict[str, Any] = {}
    for other in (v for v in VARIANTS if v in by and v != "edgefl"):
        o = by[other]
        out[f"edgefl_minus_{other}_starved_only_points"] = 100 * (
            d["final_starved_only_acc"] - o["final_starved_only_acc"]
        )
        out[f"edgefl_minus_{other}_central_points"] = 100 * (
            d["final_central_acc"] - o["final_central_acc"]
        )
        out[f"wall_edgefl_over_{other}"] = d["median_wall_s"] / o["median_wall_s"]
    if "ample" in by:
        out["edgefl_equals_ample_bit_for_bit"] = bit_identical(state["edgefl"], state["ample"])
    return out


def _print_tables(results: Sequence[dict[str, Any]], check: dict[str, Any]) -> None:
    first = next((r for r in results if r["variant"] != "ample"), results[0])
    mib = 2**20
    print(
        f"# parameters+gradients+momentum {first['state_bytes'] / mib:.1f} MiB, unmanaged peak "
        f"{first['unmanaged_peak_bytes'] / mib:.1f} MiB, starved budget "
        f"{first['starved_budget_bytes'] / mib:.1f} MiB; labels only starved clients hold: "
        f"{first['starved_only_labels']} ({first['starved_only_test_images']} test images)"
    )
    for r in results:
        if r["local_tricks_plan"]:
            plan = "; ".join(f"{k}: {v}" for k, v in r["local_tricks_plan"].items())
            print(f"# local tricks, from the measured floors: {plan}")
    print(
        "| variant | round | central acc | starved-only acc | sub-model: central, starved-only "
        "| wall s | fleet s | trained | failed | width ratios | swapped MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for row in r["rounds"]:
            ratios = ",".join(f"{x:g}" for x in row["width_ratios"])
            sub = row["starved_only_acc_submodel"]
            sub_text = "-" if sub is None else f"{row['central_acc_submodel']:.4f}, {sub:.4f}"
            print(
                f"| {LABELS[r['variant']]} | {row['round']} | {row['central_acc']:.4f} "
                f"| {row['starved_only_acc']:.4f} | {sub_text} "
                f"| {row['wall_s']:.1f} | {row['fleet_round_s']:.2f} | {row['clients_trained']} "
                f"| {row['clients_failed']} | {ratios} | {row['bytes_swapped'] / mib:.0f} |"
            )
    for key, value in check.items():
        print(f"# {key}: {value:.3f}" if isinstance(value, float) else f"# {key}: {value}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--starved", type=int, default=3, help="memory-starved clients (the first)")
    p.add_argument("--budget", type=float, default=0.6, help="starved budget / unmanaged peak")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    add_out(p)
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every variant")
    args = p.parse_args(argv)
    configure_logging()
    torch.set_num_threads(1)
    env = environment()
    print(describe(env))
    with tempfile.TemporaryDirectory() as tmp:
        reference = time_reference(settings_for(args.variants[0], args, Path(tmp) / "ref"))
        results = [run(v, args, Path(tmp) / v, reference) for v in args.variants]
    summaries = [summarize(r) for r in results]
    check = checks(results, summaries)
    _print_tables(results, check)
    rows = [{k: v for k, v in r.items() if k != "final_state"} for r in results]
    write_json_lines(
        args.out,
        env,
        [*tagged("run", rows), *tagged("summary", summaries), *tagged("check", [check])],
    )


if __name__ == "__main__":
    main()
