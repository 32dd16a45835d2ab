"""edgefl's ClientApp under a plain Flower ServerApp with Flower's FedAvg (simulation engine)."""

import dataclasses
import os
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

from edgefl.budget import Budget
from edgefl.client_app import build_client_app
from edgefl.data import load_dataset
from edgefl.models import build_model
from edgefl.settings import DeviceClass, RunSettings
from edgefl.sim import prepare

pytestmark = pytest.mark.slow
OPTIONS = {"width": 8, "hidden": 32, "convs_per_stage": 3}


def _plain_server_app(initial: dict[str, torch.Tensor], out: dict[str, Any]) -> ServerApp:
    """A ServerApp as Flower's docs write one: FedAvg.start, nothing of edgefl's server."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(fraction_train=1.0, min_available_nodes=2, min_train_nodes=2)
        out["result"] = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(initial),
            num_rounds=2,
            train_config=ConfigRecord({"lr": 0.05}),
        )

    return app


def test_edgefl_client_trains_under_flowers_fedavg(
    smoke_settings: RunSettings, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Under 75 % of the unmanaged peak, so the clients swap (vtensor's minimum is ~65 %)."""
    fleet = dataclasses.replace(
        smoke_settings.client.fleet,
        classes=(DeviceClass("tight", Budget(peak_fraction=0.75), 1.0),),
        plan_cache_root=str(tmp_path_factory.mktemp("interop-plans")),
    )
    client = dataclasses.replace(
        smoke_settings.client,
        fleet=fleet,
        model=dataclasses.replace(smoke_settings.client.model, options=OPTIONS),
    )
    settings = prepare(dataclasses.replace(smoke_settings, client=client))
    torch.manual_seed(0)
    initial = build_model("cnn", load_dataset("mnist").info, OPTIONS).state_dict()
    out: dict[str, Any] = {}
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    run_simulation(
        server_app=_plain_server_app(initial, out),
        client_app=build_client_app(settings.client),
        num_supernodes=2,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    result = out["result"]
    final = result.arrays.to_torch_state_dict()
    assert final.keys() == initial.keys()
    assert any(not torch.equal(final[k], initial[k]) for k in initial)
    assert sorted(result.train_metrics_clientapp) == [1, 2]
    for metrics in result.train_metrics_clientapp.values():
        assert metrics["bytes-swapped-out"] > 0  # trained under its budget, not unmanaged
        assert metrics["peak-device-bytes"] <= metrics["budget-bytes"]
        assert np.isfinite(metrics["train-loss"])
    assert sorted(result.evaluate_metrics_clientapp) == [1, 2]
    assert all(0.0 <= m["eval-acc"] <= 1.0 for m in result.evaluate_metrics_clientapp.values())
