"""The layers of a model for parameter offloading, their byte needs and the smallest budget.

NOTE [offload units]
A *unit* is a module that owns parameters directly. Its parameters are in memory while its
forward runs and from the start of its backward until their gradients have accumulated. A
parameter owned by several units (tied weights) belongs to all of them. Parameters of a unit
whose forward encloses others', and tied ones, stay in memory across other units' uses: they are
*long-lived*, and the smallest budget counts them in full next to the largest other unit.
"""

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vtensor.errors import ParamOffloadError
from vtensor.measure.optimizer_state import StateShape, measure_state

if TYPE_CHECKING:
    from vtensor.offload.records import ParamRecord


@dataclass(frozen=True)
class Unit:
    """One module whose parameters are brought in for its forward and backward.

    Attributes:
        index: position in registration order.
        name: the module's qualified name ("" for the root).
        params: names (as ``model.named_parameters()`` gives them) of the parameters it owns.
        encloses: True when another unit runs inside its forward (its parameters are long-lived).
    """

    index: int
    name: str
    module: nn.Module
    params: tuple[str, ...]
    encloses: bool


def find_units(model: nn.Module, resident: Iterable[str]) -> tuple[list[Unit], set[str]]:
    """The units of ``model`` and the names of parameters kept resident (``resident`` modules).

    Raises:
        ParamOffloadError: a name in ``resident`` is not a module of ``model``.
    """
    modules = dict(model.named_modules())
    resident = set(resident)
    unknown = sorted(resident - modules.keys())
    if unknown:
        raise ParamOffloadError(
            f"resident={unknown} are not modules of the model; pass names from "
            "model.named_modules()"
        )
    names = {id(p): name for name, p in model.named_parameters()}
    kept: set[str] = set()
    owners: list[tuple[str, nn.Module, tuple[str, ...]]] = []
    atomic: list[str] = []  # NOTE [torch's own modules]
    for qualname, module in modules.items():
        if any(qualname.startswith(f"{a}.") for a in atomic):
            continue  # its parameters are its atomic ancestor's
        if _atomic(module) and any(True for _ in module.children()):
            atomic.append(qualname)
            every = module.parameters()
        else:
            every = (p for p in module._parameters.values() if p is not None)
        owned = tuple(dict.fromkeys(names[id(p)] for p in every))
        if not owned:
            continue
        if any(qualname == r or qualname.startswith(f"{r}.") or r == "" for r in resident):
            kept.update(owned)
            continue
        owners.append((qualname, module, owned))
    units = []
    for index, (qualname, module, owned) in enumerate(owners):
        prefix = f"{qualname}." if qualname else ""
        encloses = any(other.startswith(prefix) for other, _, _ in owners if other != qualname)
        units.append(
            Unit(index, qualname, module, tuple(p for p in owned if p not in kept), encloses)
        )
    return units, kept


def _atomic(module: nn.Module) -> bool:
    """Whether ``module`` is one of torch's own, not a container: one unit with its children.

    NOTE [torch's own modules]
    Some of torch's modules use their children's parameters without calling the children
    (``nn.MultiheadAttention`` hands ``out_proj.weight`` to a functional forward): offloaded per
    child, such a parameter would be used while its own module is not running. So a module of
    ``torch.nn`` other than a container owns every parameter below it, as one unit.
    """
    containers = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
    return type(module).__module__.startswith("torch.nn.") and not isinstance(module, containers)


def long_lived(units: list[Unit]) -> set[str]:
    """Parameters held across other units' uses: of enclosing units, or owned by two units."""
    owners = Counter(name for unit in units for name in unit.params)
    enclosing = {name for unit in units if unit.encloses for name in unit.params}
    return enclosing | {name for name, count in owners.items() if count > 1}


def probe_state(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], dtype: torch.dtype
) -> StateShape:
    """The state ``optimizer`` keeps per parameter of ``group``; refused if not per parameter."""
    try:
        return measure_state(optimizer, group, dtype)
    except Exception as error:
        raise ParamOffloadError(
            f"cannot measure the state of {type(optimizer).__name__} ({error}); parameter "
            "offloading steps the optimizer one parameter at a time: use an optimizer whose "
            "update is per parameter (SGD, Adam, AdamW, ...)"
        ) from error


@dataclass(frozen=True)
class Footprint:
    """Bytes of the model's parameters, gradients and optimizer state, and the smallest budget.

    Attributes:
        param_bytes, grad_bytes, state_bytes: totals, as unmanaged training holds them.
        min_budget_bytes: the least budget that offloading can keep to.
        largest_unit: the unit that sets ``min_budget_bytes`` with the long-lived tensors.
    """

    param_bytes: int
    grad_bytes: int
    state_bytes: int
    min_budget_bytes: int
    largest_unit: str


def footprint(units: list[Unit], records: dict[str, "ParamRecord"], grad_copies: int) -> Footprint:
    """The totals and the smallest feasible budget (NOTE [offload units]).

    ``records``: per parameter name. A parameter at its worst holds itself, its state and
    ``grad_copies`` gradients (accumulated and new). Fixed and long-lived ones count in full; of
    the others, the largest unit.
    """
    lasting = long_lived(units)

    def full(record: "ParamRecord") -> int:
        nbytes = record.param.untyped_storage().nbytes()
        grads = grad_copies * nbytes if record.param.requires_grad else 0
        return nbytes + record.state_bytes + grads

    always = sum(full(r) for r in records.values() if r.fixed or r.name in lasting)
    worst, largest = 0, ""
    for unit in units:
        need = sum(
            full(records[n]) for n in unit.params if not records[n].fixed and n not in lasting
        )
        if need > worst:
            worst, largest = need, unit.name or "<root>"
    sizes = [(r.param.untyped_storage().nbytes(), r.param.requires_grad) for r in records.values()]
    return Footprint(
        param_bytes=sum(nbytes for nbytes, _ in sizes),
        grad_bytes=sum(nbytes for nbytes, trained in sizes if trained),
        state_bytes=sum(r.state_bytes for r in records.values()),
        min_budget_bytes=always + worst,
        largest_unit=largest,
    )
