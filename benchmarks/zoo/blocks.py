"""Running a model's blocks in order, each under ``torch.utils.checkpoint`` when asked.

The benchmark models checkpoint their blocks when ``checkpoint_blocks`` is set
(``use_reentrant=False``): the recomputation baseline of the activation-swap benchmark.
"""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def run_blocks(blocks: nn.ModuleList, x: torch.Tensor, ckpt: bool) -> torch.Tensor:
    """``x`` through every block of ``blocks``, checkpointing each one when ``ckpt``."""
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False) if ckpt else block(x)
    return x
