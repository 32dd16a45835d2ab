"""The real Flower simulation engine (Ray): smoke run, message contents, bit-identity on/off.

The budgeted runs train the main job's model (conf/model/mlp.yaml) narrowed to 3 x 256 units,
under a budget below its parameters + gradients + momentum: only offloading them trains it.
"""

import csv
import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import MessageType

import vtensor
from edgefl.budget import Budget
from edgefl.data import load_dataset
from edgefl.models import build_model
from edgefl.recording_grid import Exchange
from edgefl.records import EVAL_METRIC_KEYS, TRAIN_CONFIG_KEYS, TRAIN_METRIC_KEYS
from edgefl.settings import DeviceClass, ModelSettings, RunSettings, VTensorSettings
from edgefl.sim import measure_peak, prepare, simulate

pytestmark = pytest.mark.slow
MODEL = ModelSettings("mlp", {"hidden": 256, "layers": 3})


@pytest.fixture(scope="module")
def tight_settings(
    smoke_settings: RunSettings,
    tmp_path_factory: pytest.TempPathFactory,
) -> RunSettings:
    """3 clients, 2 rounds, under 75 % of the unmanaged peak, below the training state.

    Three clients, so that FedAvg's sum depends on the order replies are aggregated in.
    """
    fleet = dataclasses.replace(
        smoke_settings.client.fleet,
        classes=(DeviceClass("tight", Budget(peak_fraction=0.75), 1.0),),
    )
    client = dataclasses.replace(smoke_settings.client, fleet=fleet, model=MODEL)
    server = dataclasses.replace(
        smoke_settings.server,
        num_rounds=2,
        num_supernodes=3,
        output_dir=str(tmp_path_factory.mktemp("sim-on")),
    )
    return prepare(dataclasses.replace(smoke_settings, client=client, server=server))


@pytest.fixture(scope="module")
def run_on(tight_settings: RunSettings) -> tuple[dict[str, Any], list[Exchange]]:
    exchanges: list[Exchange] = []
    # As edgefl-sim runs it: the peak measured once before the simulation starts, in a process no
    # simulation thread allocates in meanwhile (NOTE [relative budgets] in edgefl.budget).
    peak = measure_peak(tight_settings)
    return simulate(tight_settings, [exchanges.append], peak=peak), exchanges


@pytest.fixture(scope="module")
def run_off(
    tight_settings: RunSettings,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    client = dataclasses.replace(tight_settings.client, vtensor=VTensorSettings(enabled=False))
    server = dataclasses.replace(
        tight_settings.server, output_dir=str(tmp_path_factory.mktemp("sim-off"))
    )
    return simulate(dataclasses.replace(tight_settings, client=client, server=server))


def test_simulation_runs_rounds_and_writes_results(
    run_on: tuple[dict[str, Any], list[Exchange]], tight_settings: RunSettings
) -> None:
    outcome, _ = run_on
    state_bytes = 3 * _parameter_bytes(tight_settings)  # parameters, gradients, momentum
    history = outcome["history"]
    assert [r.server_round for r in history.rounds] == [0, 1, 2]
    assert all(r.clients_trained == 3 and r.clients_failed == 0 for r in history.rounds[1:])
    assert all(r.central_acc is not None for r in history.rounds)
    for c in history.clients:
        if c.phase == "train":
            assert c.metrics["bytes-swapped-out"] > 0  # the budget forced swapping
            assert c.metrics["peak-device-bytes"] <= c.metrics["budget-bytes"] < state_bytes
            # Every client's 75 % budget is of the peak the run states (NOTE [relative budgets]
            # in edgefl.budget), not of a peak of its own or of another batch.
            stated = vtensor.share_of_peak(0.75, outcome["unmanaged_peak_bytes"])
            assert c.metrics["budget-bytes"] == stated
    names = {p.name for p in outcome["output_dir"].iterdir()}
    assert {
        "rounds.json",
        "rounds.csv",
        "clients.csv",
        "final_model.pt",
        "summary.txt",
        "accuracy_loss.png",
        "client_memory.png",
        "settings.json",
    } <= names
    summary = (outcome["output_dir"] / "summary.txt").read_text()
    assert "tight" in summary
    assert "could not train: budget < parameters+gradients+momentum" in summary
    assert "x unmanaged" in summary and "reference" in summary
    with (outcome["output_dir"] / "clients.csv").open() as f:
        sources = {row["plan-source"] for row in csv.DictReader(f) if row["phase"] == "train"}
    assert sources and sources <= {s.value for s in vtensor.PlanSource}  # names, not codes


def _check_arrays(record: Any, shapes: dict[str, tuple[int, ...]]) -> None:
    assert {k: tuple(a.shape) for k, a in record.items()} == shapes


def test_only_arrays_metrics_and_configs_travel(
    run_on: tuple[dict[str, Any], list[Exchange]], tight_settings: RunSettings
) -> None:
    """Every instruction and reply holds model arrays, known metrics and known config keys:
    no examples, labels or other data leave a client."""
    _, exchanges = run_on
    info = load_dataset("mnist").info
    model = build_model(MODEL.name, info, MODEL.options)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert {e.message_type for e in exchanges} == {MessageType.TRAIN, MessageType.EVALUATE}
    for exchange in exchanges:
        for msg in exchange.sent:
            content = msg.content
            assert set(content) == {"arrays", "config"}
            _check_arrays(content["arrays"], shapes)
            assert set(content["config"]) <= TRAIN_CONFIG_KEYS
            assert all(isinstance(v, int | float) for v in content["config"].values())
        assert len(exchange.replies) == len(exchange.sent)
        for reply in exchange.replies:
            assert not reply.has_error()
            content = reply.content
            # The one config a reply holds: its node's device class, by name (edgefl.records).
            assert set(content.config_records) == {"node"}
            assert dict(content["node"]) == {"device-class": "tight"}
            if exchange.message_type == MessageType.TRAIN:
                assert set(content) == {"arrays", "metrics", "node"}
                _check_arrays(content["arrays"], shapes)
                assert tuple(content["metrics"]) == TRAIN_METRIC_KEYS
            else:
                assert set(content) == {"metrics", "node"}
                assert tuple(content["metrics"]) == EVAL_METRIC_KEYS
            assert all(isinstance(v, int | float) for v in content["metrics"].values())


def _parameter_bytes(settings: RunSettings) -> int:
    info = load_dataset("mnist").info
    model = build_model(settings.client.model.name, info, settings.client.model.options)
    return sum(p.nbytes for p in model.parameters())


def test_global_model_is_bit_identical_with_vtensor_on_and_off(
    run_on: tuple[dict[str, Any], list[Exchange]], run_off: dict[str, Any]
) -> None:
    on, off = run_on[0]["final_state"], run_off["final_state"]
    assert on.keys() == off.keys()
    for key in on:
        assert torch.equal(on[key], off[key]), key
    on_acc = [(r.central_acc, r.central_loss) for r in run_on[0]["history"].rounds]
    assert on_acc == [(r.central_acc, r.central_loss) for r in run_off["history"].rounds]
    assert not np.isnan(on_acc[-1][1])


def test_a_client_whose_budget_cannot_be_met_is_dropped_and_the_round_goes_on(
    smoke_settings: RunSettings, tmp_path_factory: pytest.TempPathFactory
) -> None:
    classes = (
        DeviceClass("ok", Budget(1 << 30), 0.5),
        DeviceClass("starved", Budget(peak_fraction=0.01), 0.5),
    )
    fleet = dataclasses.replace(smoke_settings.client.fleet, classes=classes)
    server = dataclasses.replace(
        smoke_settings.server, output_dir=str(tmp_path_factory.mktemp("sim-starved"))
    )
    settings = dataclasses.replace(
        smoke_settings,
        client=dataclasses.replace(smoke_settings.client, fleet=fleet),
        server=server,
    )
    history = simulate(prepare(settings))["history"]
    last = history.rounds[-1]
    assert (last.server_round, last.clients_trained, last.clients_failed) == (1, 1, 1)
    assert last.central_acc is not None
    (error,) = history.errors()
    assert error.phase == "train" and "'starved'" in (error.error or "")
    assert "Raise the budget" in (error.error or "")
