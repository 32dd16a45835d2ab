"""A deep MLP of equal layers, whose parameters dwarf its activations at any batch size."""

import torch
from torch import nn


class DeepMLP(nn.Module):
    """Linear+ReLU layers of equal width: parameters far larger than activations at any batch."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *(m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU()))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)  # type: ignore[no-any-return]
