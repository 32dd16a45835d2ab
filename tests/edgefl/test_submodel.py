"""HeteroFL's client side: scaled options, the ratio a budget buys, a run from conf/strategy/."""

import dataclasses
from typing import Any

import pytest
import torch
from flwr.app import MessageType

from edgefl.budget import Budget
from edgefl.config import load_run_settings
from edgefl.data import load_dataset
from edgefl.errors import ConfigError
from edgefl.models import build_model
from edgefl.recording_grid import Exchange
from edgefl.settings import DeviceClass, RunSettings
from edgefl.sim import prepare, simulate
from edgefl.submodel import choose_ratio, scaled_options, slice_to_shapes
from strategies.heterofl import WIDTH_RATIO

OPTIONS = {"width": 8, "hidden": 32, "convs_per_stage": 5}


def test_scaled_options_scale_every_hidden_width() -> None:
    assert scaled_options("cnn", OPTIONS, 0.5) == {"width": 4, "hidden": 16, "convs_per_stage": 5}
    assert scaled_options("cnn", {}, 0.25) == {"width": 4, "hidden": 16}  # from the defaults
    with pytest.raises(ConfigError, match="model='char_gpt' has no width-scaled sub-models"):
        scaled_options("char_gpt", {}, 0.5)


def test_sub_model_arrays_are_leading_slices_of_the_full_model() -> None:
    info = load_dataset("mnist").info
    full = build_model("cnn", info, OPTIONS).state_dict()
    half = build_model("cnn", info, scaled_options("cnn", OPTIONS, 0.5)).state_dict()
    assert full.keys() == half.keys()
    sliced = slice_to_shapes(
        {k: v.numpy() for k, v in full.items()}, {k: tuple(v.shape) for k, v in half.items()}
    )
    assert sliced["classifier.3.weight"].shape == (10, 16)  # classes stay full
    assert sliced["features.0.weight"].shape == (4, 1, 3, 3)  # input channels stay full


def test_the_main_jobs_mlp_has_width_scaled_sub_models() -> None:
    info = load_dataset("mnist").info
    assert scaled_options("mlp", {}, 0.5) == {"hidden": 512}
    half = build_model("mlp", info, scaled_options("mlp", {}, 0.5)).state_dict()
    assert half["net.1.weight"].shape == (512, 784)  # the input stays full
    assert half["net.9.weight"].shape == (10, 512)  # so do the classes


def test_the_widest_ratio_that_fits_is_chosen() -> None:
    peaks = {1.0: 800, 0.5: 400, 0.25: 200}
    assert choose_ratio(1000, peaks) == 1.0
    assert choose_ratio(799, peaks) == 0.5
    assert choose_ratio(400, peaks) == 0.5
    assert choose_ratio(199, peaks) is None


@pytest.mark.slow
def test_heterofl_from_conf_trains_sub_models_on_the_simulation_engine(
    smoke_settings: RunSettings, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """One ample and one starved client (55 % of the peak: a half-width model fits), 2 rounds."""
    out = tmp_path_factory.mktemp("heterofl")
    s = load_run_settings(
        ["experiment=smoke", "strategy=heterofl", "num_rounds=2", f"output_dir={out}"]
    )
    classes = (
        DeviceClass("starved", Budget(peak_fraction=0.55), 0.5),
        DeviceClass("ample", Budget(1 << 30), 0.5),
    )
    fleet = dataclasses.replace(s.client.fleet, classes=classes, plan_cache_root=str(out / "p"))
    model = dataclasses.replace(s.client.model, options=OPTIONS)
    client = dataclasses.replace(s.client, fleet=fleet, model=model)
    settings = prepare(dataclasses.replace(s, client=client))
    sent: dict[int, list[Any]] = {}

    def shapes_sent(exchange: Exchange) -> None:
        if exchange.message_type == MessageType.TRAIN:
            sent[exchange.server_round] = [
                tuple(m.content["arrays"]["features.0.weight"].numpy().shape) for m in exchange.sent
            ]

    outcome = simulate(settings, [shapes_sent])
    history = outcome["history"]
    trained = [c for c in history.clients if c.phase == "train" and c.server_round == 2]
    assert sorted(c.metrics[WIDTH_RATIO] for c in trained) == [0.5, 1.0]
    assert all(c.metrics["peak-device-bytes"] <= c.metrics["budget-bytes"] for c in trained)
    assert sorted(sent[1]) == [(8, 1, 3, 3)] * 2  # round 1: the full model to both
    assert sorted(sent[2]) == [(4, 1, 3, 3), (8, 1, 3, 3)]  # round 2: the starved one its slice
    info = load_dataset("mnist").info
    torch.manual_seed(settings.client.seed)
    initial = build_model("cnn", info, OPTIONS).state_dict()
    final = outcome["final_state"]
    assert {k: v.shape for k, v in final.items()} == {k: v.shape for k, v in initial.items()}
    assert history.rounds[-1].central_acc is not None
    assert any(not torch.equal(final[k], initial[k]) for k in initial)
    assert history.rounds[-1].clients_failed == 0
