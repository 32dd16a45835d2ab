import re
from dataclasses import replace
from pathlib import Path

import pytest

import vtensor
from edgefl.config import (
    GROUPS,
    compose_config,
    group_options,
    instantiate_strategy,
    load_run_settings,
    overrides_from_run_config,
    run_settings,
)
from edgefl.errors import ConfigError
from edgefl.settings import RunSettings
from edgefl.train import open_manager

CASES = [(group, option) for group in GROUPS for option in group_options(group)]


def test_every_group_has_options() -> None:
    assert all(group_options(group) for group in GROUPS)


@pytest.mark.parametrize("group, option", CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_every_option_composes_into_settings(group: str, option: str) -> None:
    settings = run_settings(compose_config([f"{group}={option}"]))
    assert isinstance(settings, RunSettings)


@pytest.mark.parametrize("option", group_options("strategy"))
def test_every_strategy_target_instantiates(option: str) -> None:
    settings = load_run_settings([f"strategy={option}"])
    strategy = instantiate_strategy(settings.server.strategy)
    assert type(strategy).__module__.startswith(("flwr.serverapp.strategy", "strategies."))


def test_default_config_is_the_main_job() -> None:
    s = load_run_settings()
    assert s.client.data.name == "mnist"
    assert s.server.num_supernodes >= 8 and s.server.num_rounds >= 5
    assert len(s.client.fleet.classes) >= 3 and s.client.vtensor.enabled


def test_run_config_keys_become_overrides() -> None:
    run_config = {
        "dataset": "hapt",
        "model": "",
        "num-server-rounds": 3,
        "output-dir": "/tmp/x",
        "overrides": "seed=7 train.lr=0.1",
    }
    assert overrides_from_run_config(run_config) == [
        "dataset=hapt",
        "num_rounds=3",
        "output_dir=/tmp/x",
        "seed=7",
        "train.lr=0.1",
    ]


def test_bad_override_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="do not compose"):
        compose_config(["model=transformer_xl"])


def test_bad_budget_names_the_class() -> None:
    with pytest.raises(ConfigError, match=r"fleet\.classes\.edge\.budget='lots'"):
        load_run_settings(["fleet=uniform", "fleet.classes.edge.budget=lots"])


def test_fleet_classes_are_addressed_by_name_in_their_order() -> None:
    fleet = load_run_settings(["fleet.classes.micro.budget=50%"]).client.fleet
    assert [c.name for c in fleet.classes] == ["micro", "small", "medium"]
    assert fleet.classes[0].budget.peak_fraction == 0.5
    assert fleet.classes[1].budget.peak_fraction == 0.8  # the others keep conf/fleet's


def test_bad_class_budget_names_the_key_and_the_accepted_forms() -> None:
    with pytest.raises(ConfigError) as caught:
        load_run_settings(["fleet.classes.micro.budget=abc"])
    message = str(caught.value)
    assert "fleet.classes.micro.budget='abc'" in message and "\n" not in message
    assert "bytes" in message and "'80%'" in message and "'auto'" in message


def test_a_numbered_class_path_points_to_the_named_one() -> None:
    with pytest.raises(ConfigError) as caught:
        load_run_settings(["fleet.classes.0.budget=50%"])
    message = str(caught.value)
    assert "fleet.classes.micro.budget" in message and "\n" not in message
    assert "classes: 0 micro, 1 small, 2 medium" in message


@pytest.mark.parametrize(
    "override, named",
    [
        ("fleet.classes.micro.share=half", "fleet.classes.micro.share='half'"),
        ("+fleet.classes.micro.speed=2", "fleet.classes.micro.speed"),
        ("~fleet.classes.micro.budget", "fleet.classes.micro has no budget"),
    ],
)
def test_a_bad_class_entry_is_named(override: str, named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_run_settings([override])


def test_unknown_privacy_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="is not a privacy mode"):
        load_run_settings(["privacy.name=dp"])


def test_server_side_clipping_under_secure_aggregation_is_refused() -> None:
    with pytest.raises(ConfigError, match="clipping_side=client"):
        load_run_settings(
            ["privacy=central_fixed", "privacy.clipping_side=server", "secagg=secagg_plus"]
        )


def test_parameter_offloading_mode_is_checked() -> None:
    assert load_run_settings([]).client.vtensor.offload_params == "auto"
    assert load_run_settings(["vtensor.offload_params=on"]).client.vtensor.offload_params == "on"
    with pytest.raises(ConfigError, match=r"vtensor\.offload_params='always'"):
        load_run_settings(["vtensor.offload_params=always"])


@pytest.mark.parametrize("flag", ["recompute", "encode_masks"])
def test_a_vtensor_flag_is_checked_and_reaches_the_manager(flag: str, tmp_path: Path) -> None:
    assert getattr(load_run_settings([]).client.vtensor, flag) is True  # the main job's
    settings = load_run_settings([f"vtensor.{flag}=false"]).client.vtensor
    assert getattr(settings, flag) is False
    with pytest.raises(ConfigError, match=rf"vtensor\.{flag}='sometimes'"):
        load_run_settings([f"vtensor.{flag}=sometimes"])
    for on in (True, False):
        manager = open_manager(replace(settings, **{flag: on}), 1 << 30, tmp_path / "plans")
        assert manager is not None
        try:
            assert getattr(manager, flag) is on
        finally:
            manager.close()


def test_mask_encoding_may_be_left_to_the_plans(tmp_path: Path) -> None:
    settings = load_run_settings(["vtensor.encode_masks=auto"]).client.vtensor
    assert settings.encode_masks == "auto"
    manager = open_manager(settings, 1 << 30, tmp_path / "plans")
    assert manager is not None
    try:
        assert manager.encode_masks == "auto"
    finally:
        manager.close()


def test_swap_granularity_is_vtensors() -> None:
    assert load_run_settings([]).client.vtensor.granularity is vtensor.Granularity.CHUNK
    tensor = load_run_settings(["vtensor.granularity=tensor"]).client.vtensor.granularity
    assert tensor is vtensor.Granularity.TENSOR
    with pytest.raises(ConfigError, match=r"vtensor\.granularity='page'"):
        load_run_settings(["vtensor.granularity=page"])


def test_parameter_offloading_with_a_proximal_term_is_refused() -> None:
    with pytest.raises(ConfigError, match="proximal term"):
        load_run_settings(["strategy=fedprox", "vtensor.offload_params=on"])


@pytest.mark.parametrize(
    "override, named",
    [
        ("+vtensor.budget=abc", "vtensor.budget"),
        ("+train.lrr=0.1", "train.lrr"),
        ("+num_round=3", "num_round"),
    ],
)
def test_unknown_key_is_an_error_naming_the_known_ones(override: str, named: str) -> None:
    with pytest.raises(ConfigError, match=f"unknown config key {named}; the known keys"):
        load_run_settings([override])


def test_non_numeric_round_count_names_the_key() -> None:
    with pytest.raises(ConfigError, match="num_rounds='abc' is not a whole number"):
        load_run_settings(["num_rounds=abc"])
