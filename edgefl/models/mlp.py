"""The fully connected network of McMahan et al. (their "2NN"), deeper and wider; no norm layers.

McMahan et al. (2017) train 2 hidden layers of 200 ReLU units on MNIST. ``layers=4`` of
``hidden=1024`` (conf/model/mlp.yaml) grows it to 3.96 M parameters in evenly sized layers, the
largest 4 MiB. Offloading holds one layer's parameter, gradient and momentum at a time, so its
floor is a few of these layers, well below the whole training state; a CNN whose one dense
layer holds most of its parameters (McMahan's CNN: 96 %) has no such room.
"""

import math

import torch
from torch import nn


class MLP(nn.Module):
    """flatten -> [linear-relu] x layers -> linear."""

    def __init__(
        self,
        example_shape: tuple[int, ...],
        num_classes: int,
        hidden: int = 1024,
        layers: int = 4,
    ) -> None:
        super().__init__()
        body: list[nn.Module] = [nn.Flatten()]
        width = math.prod(example_shape)
        for _ in range(layers):
            body += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        body.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*body)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, *example_shape) -> (batch, num_classes) logits."""
        return self.net(x)  # type: ignore[no-any-return]
