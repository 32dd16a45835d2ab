"""One parameter's update through the pool, and clipping, bit for bit as torch's whole-model ones.

NOTE [per-parameter update]
``torch.optim`` optimizers update each parameter from its own gradient, state and group
hyperparameters only (the single-tensor, foreach and fused implementations apply the same
elementwise math). So stepping the user's optimizer on a one-parameter view of its group gives
the bits of a whole-model ``optimizer.step()``, with the state in ``optimizer.state``
(``state_dict()`` and LR schedulers keep working). Compare against the same implementation: on
CUDA torch defaults to foreach, so pass ``foreach=False`` to both sides there.

NOTE [clipping by global norm]
``clip_grad_norm_`` stacks one norm per gradient in parameter order (grouped by device and
dtype), takes the norm of the stack and scales every gradient by ``clamp(max_norm / (total +
1e-6), max=1)``. Offloading keeps each gradient's norm as it completes, combines them in the
same order (:func:`total_norm`) and scales each gradient in the update pass (:func:`clip_`):
the same ops on the same values give the same bits.
"""

from collections.abc import Sequence

import torch
from torch.utils._foreach_utils import _has_foreach_support

from vtensor.offload.offloaded import OffloadedTensor
from vtensor.offload.pool import OffloadPool
from vtensor.offload.records import ParamRecord
from vtensor.planner.trace import TensorKind


def step_parameter(optimizer: torch.optim.Optimizer, param: torch.Tensor, group: int) -> None:
    """Run ``optimizer.step()`` for ``param`` alone (its ``.grad`` set).

    The hyperparameters are group ``group``'s as they are now (a scheduler may change them).
    """
    groups = optimizer.param_groups
    optimizer.param_groups = [{**groups[group], "params": [param]}]
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = groups


def gradient_norm(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The norm of one gradient, by the op ``clip_grad_norm_`` would use for it."""
    if _has_foreach_support([grad], grad.device):
        return torch._foreach_norm([grad], norm_type)[0]
    norm: torch.Tensor = torch.linalg.vector_norm(grad, norm_type)  # torch types it Any
    return norm


def total_norm(
    norms: Sequence[tuple[torch.Tensor, torch.Tensor]], norm_type: float
) -> torch.Tensor:
    """The global norm from (gradient, its norm) pairs in parameter order, as torch takes it."""
    if not norms:
        return torch.tensor(0.0)
    order: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad, norm in norms:
        order.setdefault((grad.device, grad.dtype), []).append(norm)
    first = norms[0][0].device
    stacked = torch.stack([n.to(first) for group in order.values() for n in group])
    total: torch.Tensor = torch.linalg.vector_norm(stacked, norm_type)
    return total


def clip_(grad: torch.Tensor, max_norm: float, total: torch.Tensor) -> None:
    """Scale one gradient in place by the clip factor of ``total``, as torch does."""
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    if _has_foreach_support([grad], grad.device):
        torch._foreach_mul_([grad], coef.to(grad.device))
    else:
        grad.mul_(coef.to(grad.device))


def adopt_state(
    pool: OffloadPool,
    optimizer: torch.optim.Optimizer,
    record: ParamRecord,
    min_tensor_bytes: int,
) -> None:
    """Track the optimizer's state tensors of ``record`` (created by its first update)."""
    items = optimizer.state.get(record.param, {}).items()
    named = {t.untyped_storage()._cdata: (k, t) for k, t in items if isinstance(t, torch.Tensor)}
    for entry in list(record.state):
        if entry.storage._cdata not in named:
            record.state.remove(entry)
            pool.forget(entry)
    known = {e.storage._cdata for e in record.state}
    for storage, (key, tensor) in named.items():
        if storage not in known:
            fixed = record.fixed or tensor.untyped_storage().nbytes() < min_tensor_bytes
            name = f"{record.name}#state:{key}"  # unique: joint plans match by name
            record.state.append(pool.adopt(tensor, name, TensorKind.STATE, fixed=fixed))


def update_parameter(
    pool: OffloadPool,
    optimizer: torch.optim.Optimizer,
    record: ParamRecord,
    grad: OffloadedTensor,
    min_tensor_bytes: int,
) -> None:
    """Step ``record``'s parameter with ``grad`` (pinned), then forget the gradient.

    The parameter and its state are marked dirty: written back once unpinned.
    """
    entries = [record.entry, *record.state]
    reserve = 0 if record.state else record.state_bytes
    pool.acquire(entries, f"update of {record.name}", reserve)
    for entry in entries:
        entry.complete()  # a write still in flight must not see the update
    record.param.grad = grad.tensor
    try:
        step_parameter(optimizer, record.param, record.group)
    finally:
        record.param.grad = None
    pool.forget(grad)
    adopt_state(pool, optimizer, record, min_tensor_bytes)
    for entry in [record.entry, *record.state]:
        if not pool.is_fixed(entry):
            entry.mark_dirty()
    for entry in entries:
        pool.release(entry)
    for entry in record.state:
        if entry not in entries:
            pool.let_go(entry)
