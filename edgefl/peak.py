"""Measure a model's unmanaged training peak (vtensor's accounting) and resolve budgets by it."""

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

import vtensor
from edgefl.budget import Budget
from edgefl.data.arrays import ArrayDataset
from edgefl.train import loss_fn

_UNLIMITED_BYTES = 1 << 40


@dataclass(frozen=True)
class PeakMeasurement:
    """Peak device bytes of a step with nothing swapped, and the smallest workable budget."""

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
) -> PeakMeasurement:
    """Run ``steps`` SGD steps on a copy-free batch under an unlimited budget; report the peak.

    The model is trained in place: pass a throwaway copy.
    """
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
    return PeakMeasurement(peak, min_budget)


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
