"""A small CNN for 28x28 images: two stages of ``convs_per_stage`` 3x3 convs, each stage pooled."""

import torch
from torch import nn


class SmallCNN(nn.Module):
    """([conv-relu] x convs_per_stage -> pool) x 2 stages -> fc -> fc.

    The stages have ``width`` and ``2 * width`` channels.

    ``convs_per_stage=1`` is the classic FL "CNN"; 2 is VGG-style, with more saved activations
    per step, which is where a memory manager has room to work.
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        image_size: int = 28,
        width: int = 16,
        hidden: int = 64,
        convs_per_stage: int = 1,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = in_channels
        for cout in (width, 2 * width):
            for _ in range(convs_per_stage):
                layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]
                cin = cout
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        flat = 2 * width * (image_size // 4) ** 2
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, channels, h, w) -> (batch, num_classes) logits."""
        return self.classifier(self.features(x))  # type: ignore[no-any-return]
