"""Checkpoint and resume: a run stopped midway and resumed ends with the uninterrupted model."""

import dataclasses
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.serverapp.strategy import FedAdam

from edgefl.checkpoint import (
    CHECKPOINT_FILE,
    Checkpoint,
    capture_rng,
    load_checkpoint,
    run_key,
    save_checkpoint,
)
from edgefl.config import load_run_settings
from edgefl.errors import ConfigError
from edgefl.history import RunHistory
from edgefl.recording_grid import Exchange
from edgefl.server_app import build_strategy
from edgefl.settings import RunSettings, StrategySpec
from edgefl.sim import prepare, simulate


def _checkpoint(settings: RunSettings, server_round: int = 2) -> Checkpoint:
    strategy = FedAdam(eta=0.01)
    strategy.m_t = {"w": np.full(3, 0.5, dtype=np.float32)}  # state a resume must keep
    return Checkpoint(
        server_round,
        {"w": torch.arange(3.0)},
        strategy,
        RunHistory(),
        run_key(settings),
        capture_rng(),
        {"unmanaged_peak_bytes": 123},
    )


def test_checkpoint_round_trips_model_and_strategy_state(
    smoke_settings: RunSettings, tmp_path: Path
) -> None:
    save_checkpoint(tmp_path, _checkpoint(smoke_settings))
    loaded = load_checkpoint(tmp_path, run_key(smoke_settings))
    assert loaded.server_round == 2
    assert torch.equal(loaded.state_dict["w"], torch.arange(3.0))
    assert isinstance(loaded.strategy, FedAdam)
    assert np.array_equal(loaded.strategy.m_t["w"], np.full(3, 0.5, dtype=np.float32))
    assert loaded.extra == {"unmanaged_peak_bytes": 123}
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_FILE]  # no temporary left


def test_resume_with_other_settings_names_what_differs(
    smoke_settings: RunSettings, tmp_path: Path
) -> None:
    save_checkpoint(tmp_path, _checkpoint(smoke_settings))
    other = dataclasses.replace(
        smoke_settings,
        server=dataclasses.replace(
            smoke_settings.server,
            strategy=StrategySpec(
                "flwr.serverapp.strategy.FedMedian", smoke_settings.server.strategy.kwargs
            ),
        ),
    )
    with pytest.raises(ConfigError, match=r"strategy\.target.*FedMedian"):
        load_checkpoint(tmp_path, run_key(other))


def test_missing_or_damaged_checkpoint_is_a_clear_error(
    smoke_settings: RunSettings, tmp_path: Path
) -> None:
    key = run_key(smoke_settings)
    with pytest.raises(ConfigError, match=r"holds no checkpoint\.pt"):
        load_checkpoint(tmp_path, key)
    path = save_checkpoint(tmp_path, _checkpoint(smoke_settings))
    path.write_bytes(path.read_bytes()[:100])  # truncated
    with pytest.raises(ConfigError, match="damaged"):
        load_checkpoint(tmp_path, key)


class _StopAtRound:
    """An observer that crashes the server when round ``server_round`` starts training."""

    def __init__(self, server_round: int) -> None:
        self.server_round = server_round

    def __call__(self, exchange: Exchange) -> None:
        if exchange.server_round == self.server_round:
            raise RuntimeError(f"server stopped in round {self.server_round}")


def _run_settings(base: RunSettings, out: Path, num_rounds: int, **server: object) -> RunSettings:
    s = dataclasses.replace(
        base,
        server=dataclasses.replace(
            base.server, num_rounds=num_rounds, output_dir=str(out), **server
        ),
    )
    fleet = dataclasses.replace(s.client.fleet, plan_cache_root=str(out / "plan-cache"))
    return prepare(dataclasses.replace(s, client=dataclasses.replace(s.client, fleet=fleet)))


@pytest.mark.slow
def test_a_run_stopped_after_round_2_of_4_resumes_to_the_uninterrupted_model(
    smoke_settings: RunSettings, tmp_path: Path
) -> None:
    full = simulate(_run_settings(smoke_settings, tmp_path / "full", 4))
    stopped_dir = tmp_path / "stopped"
    with pytest.raises(RuntimeError, match="stopped in round 3"):
        simulate(_run_settings(smoke_settings, stopped_dir, 4), [_StopAtRound(3)])
    assert load_checkpoint(stopped_dir, run_key(smoke_settings)).server_round == 2

    resumed = simulate(_run_settings(smoke_settings, stopped_dir, 4, resume_from=str(stopped_dir)))
    assert resumed["last_round"] == 4
    assert [r.server_round for r in resumed["history"].rounds] == [0, 1, 2, 3, 4]
    for name, tensor in full["final_state"].items():
        assert torch.equal(resumed["final_state"][name], tensor), name
    accuracies = [r.central_acc for r in resumed["history"].rounds]
    assert accuracies == [r.central_acc for r in full["history"].rounds]
    with pytest.raises(ConfigError, match="already completed round 4"):  # before Ray starts
        _run_settings(smoke_settings, stopped_dir, 4, resume_from=str(stopped_dir))


@pytest.mark.parametrize(
    "overrides",
    [
        ["strategy=fedadam", "pacing=memory_aware"],
        ["privacy=central_fixed", "secagg=secagg_plus"],
        ["privacy=central_adaptive", "pacing=memory_aware"],
        ["privacy=local", "strategy=fedyogi", "secagg=secagg_plus"],
    ],
)
def test_every_wrapped_strategy_survives_a_checkpoint(overrides: list[str]) -> None:
    strategy = build_strategy(load_run_settings(overrides))
    restored = pickle.loads(pickle.dumps(strategy))
    assert type(restored) is type(strategy)
    assert repr(vars(restored).keys()) == repr(vars(strategy).keys())
