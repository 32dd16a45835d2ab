"""A ResNet-class network for small images (ResNet-20 layout: 3 stages of basic blocks)."""

import torch
from torch import nn

from edgefl.models.norm import group_norm


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a (projected when needed) identity shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
            group_norm(cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            group_norm(cout),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), group_norm(cout)
            )
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual sum then ReLU."""
        return self.act(self.body(x) + self.shortcut(x))  # type: ignore[no-any-return]


class SmallResNet(nn.Module):
    """Stem conv, then ``blocks_per_stage`` basic blocks at widths w, 2w, 4w (strides 1, 2, 2)."""

    def __init__(
        self, in_channels: int, num_classes: int, width: int = 16, blocks_per_stage: int = 3
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.Conv2d(in_channels, width, 3, 1, 1, bias=False),
            group_norm(width),
            nn.ReLU(),
        ]
        cin = width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            for i in range(blocks_per_stage):
                layers.append(BasicBlock(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, channels, h, w) -> (batch, num_classes) logits."""
        return self.head(self.features(x))  # type: ignore[no-any-return]
