"""Selective recomputation: which ops' outputs it keeps (the product ops), as a SAC policy.

NOTE [selective recompute]
A unit recomputed selectively runs under torch's selective activation checkpointing (SAC,
``create_selective_checkpoint_contexts``): in its forward, the outputs of its product ops
(convolutions, matrix products, fused attention: ``is_product``) go into a cache that lives
until its backward, and everything else it saves is dropped; in its backward the forward runs
again, the product ops answered from the cache and the rest (normalisations, activations,
dropout masks, additions) recomputed. It costs the time of its non-product ops rather than its
whole forward, and frees only what they made. The cache holds its tensors outside autograd's
saved tensors, so the manager never sees them: the planner counts them as unmanaged bytes
(NOTE [hybrid plan] in ``planner/recompute.py``). The rest is as for a unit recomputed whole
(NOTE [recompute] in ``activations/recompute.py``): non-reentrant checkpointing with the RNG
state preserved, the manager's hooks ignoring the second forward, the buffers put back. Where
one autograd node can stand for the unit and all its products are its convolution modules', it
goes behind that node instead, keeping their outputs itself, without SAC's dispatch mode (NOTE
[cached products] in ``activations/product_cache.py``).

SAC checks at recomputation that a cached output was not modified in place since it was
cached, and raises otherwise. Profiling therefore marks a unit unsafe to recompute selectively
(NOTE [safe to recompute] in ``activations/units.py``) when its forward modifies a product
output in place, or when a product output (or a view of one) leaves the unit, where code
outside it could modify it in place unseen.
"""

import importlib

import torch
from torch.utils.checkpoint import CheckpointPolicy

_aten = torch.ops.aten
_PRODUCTS = frozenset(
    {
        _aten.convolution.default,
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
    }
)
_FUSED_ATTENTION = "aten._scaled_dot_product_"  # flash, efficient, cudnn, the CPU flash kernel


def is_product(op: object) -> bool:
    """Whether SAC keeps the outputs of ``op`` rather than recomputing it."""
    return op in _PRODUCTS or str(op).startswith(_FUSED_ATTENTION)


def save_products(_ctx: object, op: object, *_args: object, **_kwargs: object) -> CheckpointPolicy:
    """The SAC policy: keep the outputs of product ops, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if is_product(op) else CheckpointPolicy.PREFER_RECOMPUTE


def load_sac() -> None:
    """Import what selective checkpointing imports on first use, outside any step.

    NOTE [SAC's imports]
    The first selective profile of a process imported ``torch._dynamo`` (800 modules, 26-32
    MB of Python objects on the heap), inside the profiled iteration, unless something had
    before (making a ``torch.optim`` optimizer does): the heap counter took them for the
    step's growth, so a hybrid manager's first iteration on a small ResNet read a 39 MB peak
    against the 6.7 MB of every later one, refused 75 % of its peak, and its plans stated a
    minimum of 34 MB (``tests/vtensor/measure/test_fresh_process.py``). A manager that may
    recompute imports it when made (1.3 s, once per process).
    """
    importlib.import_module("torch._dynamo")
