"""One plan for activations and parameter offloading: record the parameter side, replay it.

NOTE [one plan]
``mm.step(model, inputs=..., params=po)`` runs a ``MemoryManager`` iteration and a
``ParamOffload`` under one budget. While profiling, a :class:`JointSide` records per
parameter-side tensor (by name) the steps a use held it, its creation and whether it outlives
the iteration: ``TraceTensor``s moved ``whole``, which the LGM planner (sizes, lifetimes, uses
only) plans with the activations. Given the plan, it replays that side: it holds what the plan
has resident, lets go and reads at the planned steps; the iteration makes room before every
read the pool announces. The plan only guides: the pool still pins and reads what a use
needs (an unforeseen use costs a wait, never a wrong value) and never exceeds the budget.
"""

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch
from torch import nn

from vtensor.errors import VTensorError
from vtensor.offload.joint_side import JointSide

# Re-exported: the activation manager reaches the parameter side through this module only.
from vtensor.offload.param_offload import ParamOffload as ParamOffload
from vtensor.offload.pool import OffloadPool
from vtensor.offload.records import describe_params
from vtensor.offload.report import ParamOffloadReport as ParamOffloadReport
from vtensor.offload.units import find_units, footprint
from vtensor.planner.plan import Plan


class RoomMaker(Protocol):
    """The activation manager's side of the shared budget."""

    def make_room(self, nbytes: int) -> None:
        """Evict activations so that ``nbytes`` about to be allocated fit the budget."""
        ...


class JointStep:
    """One ``MemoryManager`` iteration and a ``ParamOffload`` under one budget (NOTE [one plan]).

    ``side`` is what the iteration drives while it is profiled (``record``) or replays ``plan``
    (while ``replaying()``); None when reactive.
    """

    def __init__(
        self,
        params: ParamOffload,
        plan: Plan | None,
        replaying: Callable[[], bool],
        *,
        record: bool,
    ) -> None:
        self.params = params
        self.side = JointSide(params.pool, plan, replaying) if plan is not None or record else None

    @property
    def created_state(self) -> bool:
        """A profiled iteration whose first update created optimizer state (not steady)."""
        return self.side is not None and self.side.created_state

    @contextlib.contextmanager
    def connected_to(self, room: RoomMaker) -> Iterator[None]:
        """Connect the pool to ``room`` for the block; disconnect afterwards, even on error."""
        pool = self.params.pool
        pool.connect(self.side, room.make_room)
        # No lookahead in a shared budget: it would read ahead as far as the whole budget allows,
        # blind to the activations beside it. A replayed plan reads ahead where it planned to.
        self.params.passes.joint = True
        try:
            yield
        finally:
            self.params.passes.joint = False
            # A replayed plan keeps holding what it has resident: the next iteration starts there.
            pool.disconnect(keep_listener=self.side is not None and self.side.plan is not None)


def check_joint(
    params: ParamOffload,
    model: nn.Module,
    optimizer: object,
    budget_bytes: int,
    device: torch.device,
    unit: str,
    *,
    chunked: bool,
) -> None:
    """Refuse a joint step that cannot share one plan (``unit``: the manager's swap unit)."""
    if params.model is not model:
        raise VTensorError("step(params=...) needs the ParamOffload of the model being stepped")
    if optimizer is not None:
        raise VTensorError(
            "step(optimizer=..., params=...): the optimizer's state is offloaded by the "
            "ParamOffload; leave optimizer out of step()"
        )
    if params.budget_bytes != budget_bytes:
        raise VTensorError(
            f"one plan needs one budget: ParamOffload(budget={params.budget_bytes}) and "
            f"MemoryManager(budget={budget_bytes}); give both the same budget"
        )
    if device.type != "cpu" or not chunked:
        raise VTensorError(
            "step(params=...) plans parameter offloading on the CPU at chunk granularity "
            f"(device {device.type}, {unit})"
        )


def held_outside(pool: OffloadPool, model: nn.Module) -> int:
    """Bytes the pool holds in memory that are not the model's parameters (optimizer state)."""
    model_storages = {p.untyped_storage()._cdata for p in model.parameters()}
    return sum(
        e.nbytes for e in pool.tensors if e.in_memory and e.storage._cdata not in model_storages
    )


# NOTE [offload auto]
# ``MemoryManager(offload_params="auto")`` offloads a model's parameters, gradients and
# optimizer state (a ``ParamOffload`` under the manager's budget, planned with the activations)
# where they would take more than this share of the budget: what is left could not hold a step's
# working set and the activations that must stay. Where the profiled iteration then shows the
# unmanaged peak fits the budget after all, the offloading is let go for good: in memory, the
# state costs no transfers.
AUTO_OFFLOAD_SHARE = 0.5


def state_bytes(
    parameters: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    pending: int,
) -> int:
    """Parameters, buffers, gradients and optimizer state, with ``pending`` state to come.

    The tensors come from the caller's own walk of the model (a manager's scan): walking the
    modules again each step costs a short step.
    """
    params = sum(p.nbytes for p in parameters) + sum(b.nbytes for b in buffers)
    grads = sum(p.nbytes for p in parameters if p.requires_grad)
    states = optimizer.state.values() if optimizer is not None else ()
    state = sum(v.nbytes for s in states for v in s.values() if isinstance(v, torch.Tensor))
    return params + grads + state + pending


def offloaded_min_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The least the parameter side holds at once when offloaded (NOTE [offload units])."""
    units, kept = find_units(model, ())
    records = describe_params(model, optimizer, units, kept, 4096)
    return footprint(units, records, 1).min_budget_bytes
