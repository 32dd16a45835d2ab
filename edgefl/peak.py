"""Measure a model's unmanaged training peak (vtensor's accounting) and resolve budgets by it."""

import copy
import dataclasses
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

    ``state_bytes`` is what training keeps between steps: parameters, gradients and the
    optimizer's state (SGD's momentum); no batch size, micro-batching or checkpointing goes
    below it. ``smaller_batch_peaks`` are the unmanaged peaks at ``batch_size`` / 2, / 4, ...,
    1, largest batch first (``measure_floors``; empty where not measured).
    """

    unmanaged_peak_bytes: int
    min_budget_bytes: int
    state_bytes: int = 0
    batch_size: int = 0
    smaller_batch_peaks: tuple[tuple[int, int], ...] = ()


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
    return PeakMeasurement(peak, min_budget, training_state_bytes(model, optimizer), len(idx))


def measure_floors(
    model: nn.Module,
    data: ArrayDataset,
    batch_size: int,
    *,
    lr: float,
    momentum: float,
    settings: VTensorSettings | None = None,
) -> PeakMeasurement:
    """``measure_unmanaged_peak`` of a copy of ``model``, with the peaks at smaller batches.

    A smaller batch, or micro-batches of it accumulated into the same update, trains without
    vtensor where its unmanaged peak fits the budget; ``smaller_batch_peaks`` says which do.
    Without ``settings`` (vtensor off) no client states a minimum: ``min_budget_bytes`` is 0.
    """
    full = measure_unmanaged_peak(
        copy.deepcopy(model), data, batch_size, lr=lr, momentum=momentum, settings=settings
    )
    if settings is None:
        full = dataclasses.replace(full, min_budget_bytes=0)
    smaller = []
    batch = full.batch_size // 2
    while batch >= 1:
        peak = measure_unmanaged_peak(copy.deepcopy(model), data, batch, lr=lr, momentum=momentum)
        smaller.append((batch, peak.unmanaged_peak_bytes))
        batch //= 2
    return dataclasses.replace(full, smaller_batch_peaks=tuple(smaller))


def training_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, their gradients and the optimizer's state tensors."""
    params = sum(p.nbytes for p in model.parameters())
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    state = sum(
        t.nbytes
        for per_param in optimizer.state.values()
        for t in per_param.values()
        if isinstance(t, torch.Tensor)
    )
    return params + grads + state


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
