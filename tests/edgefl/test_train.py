"""The memory rules of local training: when parameters are offloaded, when evaluation streams."""

import dataclasses
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
    offloads_params,
    parameter_bytes,
    streams_layers,
    train_local,
)

MODEL = nn.Linear(64, 16)  # 4,160 bytes of parameters
PARAMS = parameter_bytes(MODEL)
CROWDED = 4 * PARAMS  # weights, gradients and momentum take 3/4 of it: over half
ROOMY = 8 * PARAMS


def _offloads(budget_bytes: int, *, proximal_mu: float = 0.0, **settings: Any) -> bool:
    vt = dataclasses.replace(VTensorSettings(), **settings)
    return offloads_params(vt, MODEL, budget_bytes, momentum=0.9, proximal_mu=proximal_mu)


def test_auto_offloads_parameters_only_when_they_crowd_the_budget() -> None:
    assert PARAMS == 4 * (64 * 16 + 16)
    assert _offloads(CROWDED) and not _offloads(ROOMY)
    # Without momentum two copies (weights, gradients) are counted, not three.
    vt = VTensorSettings()
    assert not offloads_params(vt, MODEL, CROWDED, momentum=0.0, proximal_mu=0.0)


def test_auto_never_offloads_under_fedprox_or_whole_tensor_swapping() -> None:
    assert not _offloads(CROWDED, proximal_mu=0.01)
    assert not _offloads(CROWDED, granularity=vtensor.Granularity.TENSOR)


def test_on_and_off_and_vtensor_off_override_the_rule() -> None:
    assert _offloads(ROOMY, offload_params=OffloadParams.ON)
    assert not _offloads(CROWDED, offload_params=OffloadParams.OFF)
    assert not _offloads(CROWDED, enabled=False, offload_params=OffloadParams.ON)


def test_offloading_under_a_proximal_term_is_a_config_error() -> None:
    check_offload_params(False, 0.01)
    check_offload_params(True, 0.0)
    with pytest.raises(ConfigError, match="proximal term"):
        check_offload_params(True, 0.01)
    data = ArrayDataset(np.zeros((4, 64), np.float32), np.zeros(4, np.int64))
    local = LocalRound(lr=0.1, momentum=0.9, epochs=1, batch_size=2, seed=0, proximal_mu=0.01)
    with pytest.raises(ConfigError, match="proximal term"):
        train_local(MODEL, data, local, offload_params=True)


def test_evaluation_streams_layers_when_parameters_exceed_half_the_budget() -> None:
    assert streams_layers(VTensorSettings(), MODEL, 2 * PARAMS - 2)
    assert not streams_layers(VTensorSettings(), MODEL, 2 * PARAMS)
    assert not streams_layers(VTensorSettings(enabled=False), MODEL, PARAMS)
