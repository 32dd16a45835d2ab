"""What a step holds before any activation is saved: the device, storages and bytes of state.

State is the model's parameters, buffers and gradients and the optimizer's tensors; the
manager never swaps them (``ParamOffload`` does), and with the batch they are the baseline.
"""

from collections.abc import Sequence

import torch
from torch import nn

from vtensor.errors import InfeasibleBudgetError
from vtensor.sizes import format_bytes


def device_of(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (CPU for a model with neither)."""
    for param in model.parameters():
        return param.device
    for buffer in model.buffers():
        return buffer.device
    return torch.device("cpu")


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Parameters, buffers, gradients and the optimizer's state tensors."""
    tensors: list[torch.Tensor] = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def storages_of(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> set[int]:
    """Identities of the storages of the state: never adopted by the store."""
    return {t.untyped_storage()._cdata for t in state_tensors(model, optimizer)}


def baseline_bytes(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    inputs: Sequence[torch.Tensor],
    device: torch.device,
) -> int:
    """Bytes of the state and ``inputs`` on ``device``, each storage once."""
    seen: dict[int, int] = {}
    for tensor in [*state_tensors(model, optimizer), *inputs]:
        if tensor.device.type == device.type:
            storage = tensor.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def start_bytes(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    inputs: Sequence[torch.Tensor],
    device: torch.device,
    budget_bytes: int,
    pending_state_bytes: int,
    held_bytes: int = 0,
) -> int:
    """Device bytes before any activation is saved; raises if they alone break the budget.

    ``held_bytes`` are held elsewhere (a parameter offloading's optimizer state); the stated
    minimum counts ``pending_state_bytes``, the optimizer's state to come.

    Raises:
        InfeasibleBudgetError: the state and the inputs alone exceed ``budget_bytes``.
    """
    baseline = baseline_bytes(model, optimizer, inputs, device) + held_bytes
    if baseline > budget_bytes:
        raise InfeasibleBudgetError(
            budget_bytes,
            baseline + pending_state_bytes,
            "start",
            f"parameters, gradients, optimizer state and inputs alone take "
            f"{format_bytes(baseline)} before any activation is saved",
        )
    return baseline
