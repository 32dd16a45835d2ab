"""What offloading holds for each parameter, checked against the model and the optimizer."""

from dataclasses import dataclass, field

import torch
from torch import nn

from vtensor.errors import ParamOffloadError
from vtensor.measure.optimizer_state import StateShape
from vtensor.offload.offloaded import OffloadedTensor
from vtensor.offload.units import Unit, probe_state


@dataclass
class ParamRecord:
    """One parameter and what offloading holds for it.

    Attributes:
        name, param: the parameter and its name in ``model.named_parameters()``.
        group: its optimizer group (-1: frozen and not in the optimizer).
        fixed: stays in memory (small, or in a ``resident`` module).
        state_bytes: its optimizer state once stepped (measured on a proxy).
        units: the units that own it.
        entry: its bytes as an offloaded tensor.
        state: its optimizer state tensors, once created.
        acc: the gradient accumulated over earlier micro-batches of the step.
        grad, norm: the final gradient awaiting the clip-and-update pass, and its norm.
    """

    name: str
    param: nn.Parameter
    group: int
    fixed: bool
    state_bytes: int
    units: list[int]
    entry: OffloadedTensor = field(init=False)
    state: list[OffloadedTensor] = field(default_factory=list)
    acc: OffloadedTensor | None = None
    grad: OffloadedTensor | None = None
    norm: torch.Tensor | None = None


def describe_params(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    units: list[Unit],
    kept: set[str],
    min_tensor_bytes: int,
) -> dict[str, ParamRecord]:
    """A record per parameter of ``model``, checked against ``optimizer``.

    Raises:
        ParamOffloadError: the optimizer holds foreign tensors or misses a trainable parameter,
            or a parameter is not on the CPU.
    """
    groups = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    named = dict(model.named_parameters())
    extra = len(groups) - len({id(p) for p in named.values()} & groups.keys())
    if extra:
        raise ParamOffloadError(
            f"the optimizer holds {extra} tensors that are not parameters of the model; "
            "give it model.parameters() (or groups of them)"
        )
    records: dict[str, ParamRecord] = {}
    shapes: dict[tuple[int, torch.dtype], StateShape] = {}
    for name, param in named.items():
        if param.device.type != "cpu":
            raise ParamOffloadError(
                f"parameter {name!r} is on {param.device}; parameter offloading runs on the "
                "CPU with the swap-file tier: move the model to the CPU"
            )
        if param.requires_grad and id(param) not in groups:
            raise ParamOffloadError(
                f"parameter {name!r} requires grad but is not in the optimizer: add it, or "
                f"freeze it with requires_grad_(False)"
            )
        group = groups.get(id(param), -1)
        state_bytes = 0
        if group >= 0:
            key = (group, param.dtype)
            if key not in shapes:
                shapes[key] = probe_state(optimizer, optimizer.param_groups[group], param.dtype)
            state_bytes = shapes[key].nbytes(param)
        owners = [u.index for u in units if name in u.params]
        small = param.untyped_storage().nbytes() < min_tensor_bytes
        fixed = name in kept or not owners or small
        records[name] = ParamRecord(name, param, group, fixed, state_bytes, owners)
    return records


def use_counts(record: ParamRecord) -> tuple[int, int]:
    """References to the parameter's TensorImpl and to its storage (autograd's saves add some)."""
    tensor_refs = int(record.param._use_count())  # type: ignore[attr-defined]
    return tensor_refs, int(torch._C._storage_Use_Count(record.entry.storage._cdata))


def grew(after: tuple[int, int], before: tuple[int, int]) -> bool:
    """True when either count rose: the parameter was saved for backward."""
    return after[0] > before[0] or after[1] > before[1]
