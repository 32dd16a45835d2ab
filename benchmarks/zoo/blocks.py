"""Running a model's blocks in order, each under ``torch.utils.checkpoint`` when asked.

The benchmark models checkpoint their blocks when ``checkpoint_blocks`` is set
(``use_reentrant=False``): the recomputation baselines of the activation-swap benchmark.
``True`` recomputes each block whole; ``"selective"`` uses torch's selective activation
checkpointing to save the outputs of convolutions and matrix products (expensive to rebuild)
and recompute the rest (normalisations, activations, additions).
"""

import functools

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

_aten = torch.ops.aten
_PRODUCTS = frozenset(
    {_aten.convolution.default, _aten.mm.default, _aten.addmm.default, _aten.bmm.default}
)


def save_products(_ctx: object, op: object, *_args: object, **_kwargs: object) -> CheckpointPolicy:
    """The selective checkpointing policy: keep products' outputs, recompute the rest."""
    if op in _PRODUCTS or str(op).startswith("aten._scaled_dot_product_"):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_selective = functools.partial(create_selective_checkpoint_contexts, save_products)


def run_blocks(blocks: nn.ModuleList, x: torch.Tensor, ckpt: bool | str) -> torch.Tensor:
    """``x`` through every block of ``blocks``, checkpointed as ``ckpt`` says."""
    for block in blocks:
        if ckpt == "selective":
            x = checkpoint(block, x, use_reentrant=False, context_fn=_selective)
        elif ckpt:
            x = checkpoint(block, x, use_reentrant=False)
        else:
            x = block(x)
    return x
