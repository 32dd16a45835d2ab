"""Measure a model's unmanaged training peak (vtensor's accounting) and resolve budgets by it."""

import copy
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import vtensor
from edgefl.budget import Budget
from edgefl.data.arrays import ArrayDataset
from edgefl.settings import VTensorSettings
from edgefl.train import loss_fn, offload_setting, open_manager

_UNLIMITED_BYTES = 1 << 40


@dataclass(frozen=True)
class PeakMeasurement:
    """Peak device bytes of a step with nothing swapped, and the smallest workable budget.

    The smallest workable budget is the one a client with ``settings`` states: vtensor's
    minimum of the whole iteration, measured from far below it (``stated_minimum``), so the
    server's warning and the clients' errors name one figure.
    """

    unmanaged_peak_bytes: int
    min_budget_bytes: int


def measure_unmanaged_peak(
    model: nn.Module,
    data: ArrayDataset,
    batch_size: int,
    *,
    lr: float = 0.01,
    momentum: float = 0.9,
    steps: int = 2,
    settings: VTensorSettings | None = None,
) -> PeakMeasurement:
    """Run ``steps`` SGD steps on a copy-free batch under an unlimited budget; report the peak.

    With a client's vtensor ``settings``, also the minimum such a client states; else the
    unlimited run's. The model is trained in place: pass a throwaway copy.
    """
    probe = copy.deepcopy(model) if settings is not None else None
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    idx = np.arange(min(batch_size, len(data)))
    x, y = torch.from_numpy(data.x[idx]), torch.from_numpy(data.y[idx])
    peak = min_budget = 0
    # What torch itself saves: the budgets are fractions of the unmanaged peak.
    with vtensor.MemoryManager(_UNLIMITED_BYTES, encode_masks=False) as manager:
        for _ in range(steps):  # the second step includes the optimizer's momentum buffers
            optimizer.zero_grad(set_to_none=True)
            with manager.step(model, optimizer, (x, y)):
                loss_fn(model(x), y).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            rep = manager.report()
            peak = max(peak, rep.peak_device_bytes)
            min_budget = max(min_budget, rep.min_budget_bytes)
    if probe is not None and settings is not None:
        min_budget = stated_minimum(probe, (x, y), settings, lr=lr, momentum=momentum)
    return PeakMeasurement(peak, min_budget)


def stated_minimum(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    settings: VTensorSettings,
    *,
    lr: float,
    momentum: float,
) -> int:
    """The minimum a client with ``settings`` states for a step on ``batch``, from far below.

    A step at a one-byte budget runs to its end and raises vtensor's
    ``InfeasibleBudgetError``, whose minimum is the whole iteration's (with the parameters
    offloaded where the client would offload them). The model is trained in place.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    x, y = batch
    with tempfile.TemporaryDirectory() as scratch:
        manager = open_manager(settings, 1, Path(scratch), offload_setting(settings, 0.0))
        assert manager is not None  # vtensor is on where a minimum is asked for
        with manager:
            for _ in range(2):  # the second step holds the optimizer's state
                optimizer.zero_grad(set_to_none=True)
                try:
                    with manager.step(model, optimizer, (x, y)):
                        loss_fn(model(x), y).backward()  # type: ignore[no-untyped-call]
                except vtensor.InfeasibleBudgetError as err:
                    return err.min_budget_bytes
                optimizer.step()
    return 1


_PEAKS: dict[tuple[Any, ...], int] = {}


def resolve_budget(
    budget: Budget, model: nn.Module, data: ArrayDataset, batch_size: int, key: tuple[Any, ...]
) -> int:
    """Bytes of ``budget`` for training ``model`` on ``data`` at ``batch_size``.

    ``key`` names model and batch for the per-process cache of measured peaks (see
    NOTE [relative budgets] in edgefl.budget).
    """
    if budget.bytes:
        return budget.bytes
    # The peak is measured on one batch of at most len(data) examples: a small local test set
    # gives a smaller peak than training at batch_size, so the examples used are in the key.
    key = (*key, min(batch_size, len(data)))
    if key not in _PEAKS:
        measured = measure_unmanaged_peak(copy.deepcopy(model), data, batch_size)
        _PEAKS[key] = measured.unmanaged_peak_bytes
    return budget.of_peak(_PEAKS[key])
