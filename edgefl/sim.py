"""Run a federated simulation from Hydra config on Flower's simulation engine (``edgefl-sim``).

NOTE [simulation path]: this entry point uses ``flwr.simulation.run_simulation`` (deprecated in
1.42, still supported) rather than ``flwr run``: it runs the ServerApp in this process and the
ClientApps in Ray actors, so the full nested Hydra config travels in closures (``flwr run``
flattens config to ``[tool.flwr.app.config]`` keys), results come straight back, and nothing is
left running afterwards (``flwr run`` spawns a detached SuperLink on a fixed port that outlives
the command and is shared by every FLWR_HOME on the machine). ``flwr run .`` works too, through
the module-level ``app`` objects and ``--run-config`` keys (see edgefl.config).
"""

import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from edgefl.client_app import build_client_app
from edgefl.client_data import client_split
from edgefl.config import GROUPS, config_info, config_text, group_options, load_run_settings
from edgefl.errors import EdgeFLError
from edgefl.fleet import fleet_in_bytes
from edgefl.log_setup import configure_logging
from edgefl.models import build_model
from edgefl.peak import PeakMeasurement, measure_floors
from edgefl.ray_cluster import ray_init_args
from edgefl.recording_grid import ExchangeObserver
from edgefl.reference import ReferenceRound, time_unmanaged_round
from edgefl.results import check_output_dir
from edgefl.server_app import build_server_app, resume_point
from edgefl.settings import RunSettings
from edgefl.summary import floors_line, without_vtensor
from edgefl.sweep import is_multirun, run_multirun
from vtensor import format_bytes

logger = logging.getLogger("edgefl.sim")  # not __name__: "__main__" under python -m
_OFFLINE_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "TQDM_DISABLE": "1",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",  # silences a FutureWarning; no GPUs are used
}


def prepare(settings: RunSettings) -> RunSettings:
    """Fill run-time defaults and fail fast on bad config.

    The output folder is created and written to first; the plan cache goes under it; client 0's
    data is loaded and the model built before any simulation engine starts.
    """
    check_output_dir(Path(settings.server.output_dir))
    fleet = settings.client.fleet
    if fleet.plan_cache_root is None:
        fleet = dataclasses.replace(
            fleet, plan_cache_root=str(Path(settings.server.output_dir) / "plan-cache")
        )
    client = dataclasses.replace(settings.client, fleet=fleet)
    info, _, _ = client_split(
        client.data, client.data.root, 0, settings.server.num_supernodes, client.seed
    )
    build_model(client.model.name, info, client.model.options)
    prepared = dataclasses.replace(settings, client=client)
    resume_point(prepared)  # a run to resume is checked before any engine starts
    return prepared


def measure_peak(settings: RunSettings) -> PeakMeasurement:
    """Measure the floors on client 0's data in this (still quiet) process; log them by budgets.

    The floors (``edgefl.peak.measure_floors``): parameters + gradients + momentum, the
    unmanaged peak at the run's batch and at smaller ones, and the smallest workable budget a
    client states. Each class's budget is logged beside what would train in it without vtensor
    (NOTE [without vtensor] in edgefl.summary); a budget below the smallest workable one warns.
    """
    c = settings.client
    info, train, _ = client_split(c.data, c.data.root, 0, settings.server.num_supernodes, c.seed)
    torch.manual_seed(c.seed)
    torch.set_num_threads(c.train.torch_threads)  # as clients train: threads change workspaces
    peak = measure_floors(
        build_model(c.model.name, info, c.model.options),
        train,
        c.train.batch_size,
        lr=c.train.lr,
        momentum=c.train.momentum,
        settings=c.vtensor if c.vtensor.enabled else None,
    )
    resolved = []
    for device in c.fleet.classes:
        budget = device.budget.of_peak(peak.unmanaged_peak_bytes)
        stated = f"{device.budget}" + ("" if device.budget.bytes else f" = {format_bytes(budget)}")
        resolved.append(
            f"  {device.name}: {stated}; without vtensor: {without_vtensor(budget, peak)}"
        )
        if c.vtensor.enabled and budget < peak.min_budget_bytes:
            logger.warning(
                "device class %s: budget %s is below the smallest workable budget %s; "
                "its clients may reply with errors",
                device.name,
                format_bytes(budget),
                format_bytes(peak.min_budget_bytes),
            )
    logger.info("floors (measured here): %s\nbudgets:\n%s", floors_line(peak), "\n".join(resolved))
    return peak


def time_reference(settings: RunSettings) -> ReferenceRound:
    """Time client 0's first round unmanaged, before any client starts (NOTE [reference round])."""
    reference = time_unmanaged_round(settings.client, settings.server.num_supernodes)
    logger.info(
        "reference: client 0 trains its round unmanaged in %.1f s (%d examples, vtensor off)",
        reference.train_s,
        reference.examples_processed,
    )
    return reference


def simulate(
    settings: RunSettings,
    observers: Sequence[ExchangeObserver] = (),
    peak: PeakMeasurement | None = None,
    reference: ReferenceRound | None = None,
) -> dict[str, Any]:
    """Run the simulation; return the ServerApp's outcome (history, final_state, output_dir).

    With ``simulation.ray_address`` set, clients run on that existing Ray cluster: Flower passes
    ``init_args`` to ``ray.init`` and at the end only disconnects (``ray.shutdown()`` in a driver
    that connected stops no cluster process), so the cluster outlives the run. With ``peak``
    given, clients get their budgets in bytes of it (NOTE [relative budgets] in edgefl.budget).
    """
    from flwr.simulation import run_simulation  # heavy (Ray); imported only to simulate

    for key, value in _OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    configure_logging(settings.simulation.flower_log_level)
    outcome: dict[str, Any] = {}
    sim = settings.simulation
    client = settings.client
    if peak is not None:
        fleet = fleet_in_bytes(client.fleet, peak.unmanaged_peak_bytes)
        client = dataclasses.replace(client, fleet=fleet)
    run_simulation(
        server_app=build_server_app(settings, observers, outcome, peak, reference),
        client_app=build_client_app(client),
        num_supernodes=settings.server.num_supernodes,
        backend_config={
            "client_resources": {"num_cpus": sim.client_num_cpus, "num_gpus": 0.0},
            "init_args": ray_init_args(sim),
        },
        verbose_logging=sim.flower_log_level.upper() == "DEBUG",
    )
    if "history" not in outcome:
        raise EdgeFLError(
            "the simulation ended without results: the ServerApp failed "
            "(see the Flower log above; rerun with debug=verbose)"
        )
    return outcome


def main(argv: Sequence[str] | None = None) -> int:
    """``edgefl-sim [hydra overrides...]``; ``--help`` lists the config groups."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(_usage())
        return 0
    configure_logging()
    if "--info" in args or any(a in ("-c", "--cfg") or a.startswith("--cfg=") for a in args):
        return _show_config(args)
    if is_multirun(args):
        return _multirun(args)
    try:
        settings = prepare(load_run_settings(args))
        logger.info(
            "simulating %d clients for %d rounds; results will go to %s",
            settings.server.num_supernodes,
            settings.server.num_rounds,
            settings.server.output_dir,
        )
        outcome = simulate(
            settings, peak=measure_peak(settings), reference=time_reference(settings)
        )
    except EdgeFLError as exc:
        logger.error("%s", exc)
        return 2
    files = ", ".join(p.name for p in outcome["result_files"])  # as the ServerApp logged them
    print(f"results: {outcome['output_dir']} ({files})")
    return 0


def _multirun(args: list[str]) -> int:
    """A Hydra multirun (docs/sweeps.md): every job runs as a single run, into its job folder."""
    try:
        return run_multirun(args, _simulate_job)
    except EdgeFLError as exc:
        logger.error("%s", exc)
        return 2


def _simulate_job(settings: RunSettings) -> None:
    """One job of a multirun: the single run's steps on its settings."""
    settings = prepare(settings)
    logger.info("results will go to %s", settings.server.output_dir)
    simulate(settings, peak=measure_peak(settings), reference=time_reference(settings))


def _show_config(args: list[str]) -> int:
    """Hydra's ``--cfg job|hydra|all`` and ``--info``: print the config, run nothing."""
    overrides, part, info = [], None, False
    words = iter(args)
    for word in words:
        if word == "--info":
            info = True
        elif word in ("-c", "--cfg"):
            part = next(words, "")
        elif word.startswith("--cfg="):
            part = word.split("=", 1)[1]
        else:
            overrides.append(word)
    try:
        text = config_info(overrides) + "\n" if info else config_text(overrides, part or "job")
        print(text, end="")
    except EdgeFLError as exc:
        logger.error("%s", exc)
        return 2
    return 0


def _usage() -> str:
    lines = [
        "usage: edgefl-sim [key=value ...]   (Hydra overrides of conf/config.yaml)",
        "config groups (group=option):",
    ]
    lines += [f"  {g}: {', '.join(group_options(g))}" for g in GROUPS]
    lines.append("examples: edgefl-sim experiment=hapt   edgefl-sim num_rounds=10 vtensor=disabled")
    lines.append("sweeps (Hydra multirun): edgefl-sim -m strategy=fedavg,fedprox (docs/sweeps.md)")
    lines.append("show the config, run nothing: --cfg job|hydra|all, --info (as Hydra's)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
