"""The memory rules of local training: when parameters are offloaded, when evaluation streams."""

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch import nn

import vtensor
from edgefl.data.arrays import ArrayDataset
from edgefl.errors import ConfigError
from edgefl.settings import OffloadParams, VTensorSettings
from edgefl.train import (
    LocalRound,
    check_offload_params,
    offload_setting,
    parameter_bytes,
    streams_layers,
    train_within_budget,
)

MODEL = nn.Linear(64, 16)  # 4,160 bytes of parameters
PARAMS = parameter_bytes(MODEL)


def _setting(*, proximal_mu: float = 0.0, **settings: Any) -> bool | str:
    return offload_setting(dataclasses.replace(VTensorSettings(), **settings), proximal_mu)


def test_auto_leaves_the_rule_to_vtensor_but_under_fedprox_or_whole_tensor_swapping() -> None:
    assert _setting() == "auto"  # vtensor offloads where the state takes over half the budget
    assert _setting(proximal_mu=0.01) is False
    assert _setting(granularity=vtensor.Granularity.TENSOR) is False


def test_on_and_off_and_vtensor_off_override_the_rule() -> None:
    assert _setting(offload_params=OffloadParams.ON) is True
    assert _setting(offload_params=OffloadParams.OFF) is False
    assert _setting(enabled=False, offload_params=OffloadParams.ON) is False


def test_offloading_under_a_proximal_term_is_a_config_error(tmp_path: Path) -> None:
    check_offload_params(False, 0.01)
    check_offload_params(True, 0.0)
    with pytest.raises(ConfigError, match="proximal term"):
        check_offload_params(True, 0.01)
    data = ArrayDataset(np.zeros((4, 64), np.float32), np.zeros(4, np.int64))
    local = LocalRound(lr=0.1, momentum=0.9, epochs=1, batch_size=2, seed=0, proximal_mu=0.01)
    on = VTensorSettings(offload_params=OffloadParams.ON)
    with pytest.raises(ConfigError, match="proximal term"):
        train_within_budget(
            MODEL, data, local, settings=on, budget_bytes=1 << 20, plan_cache_dir=tmp_path
        )


def test_evaluation_streams_layers_when_parameters_exceed_half_the_budget() -> None:
    assert streams_layers(VTensorSettings(), MODEL, 2 * PARAMS - 2)
    assert not streams_layers(VTensorSettings(), MODEL, 2 * PARAMS)
    assert not streams_layers(VTensorSettings(enabled=False), MODEL, PARAMS)


def test_seed_everything_sets_deterministic_ops_without_the_compiler() -> None:
    """A deployed node pays each import in every message's process (NOTE [deterministic ops])."""
    code = (
        "import sys, torch\n"
        "from edgefl.train import seed_everything\n"
        "seed_everything(0, 1)\n"
        "assert torch.are_deterministic_algorithms_enabled()\n"
        "assert torch.is_deterministic_algorithms_warn_only_enabled()\n"
        "assert 'torch._inductor' not in sys.modules, 'the inductor was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
