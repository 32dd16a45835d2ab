"""A MobileNetV2-class network for small images: inverted residuals with x6 expansion."""

import torch
from torch import nn

from edgefl.models.norm import group_norm

# (expansion t, output channels c, repeats n, first stride s), scaled by ``width_mult``; strides
# are reduced against ImageNet's MobileNetV2 because inputs are 28-32 px.
_BLOCKS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 2, 2), (6, 96, 1, 1))


def _conv(
    cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True
) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
        group_norm(cout),
    ]
    if act:
        layers.append(nn.ReLU6())
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """1x1 expand -> 3x3 depthwise -> 1x1 project, with a skip when shapes allow."""

    def __init__(self, cin: int, cout: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = cin * expansion
        layers: list[nn.Module] = [] if expansion == 1 else [_conv(cin, hidden, 1)]
        layers += [
            _conv(hidden, hidden, 3, stride, groups=hidden),
            _conv(hidden, cout, 1, act=False),
        ]
        self.body = nn.Sequential(*layers)
        self.skip = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block (shape changes only through stride and channel count)."""
        out = self.body(x)
        return x + out if self.skip else out  # type: ignore[no-any-return]


class MobileNetV2Small(nn.Module):
    """MobileNetV2-style classifier; activations dominate its training memory."""

    def __init__(
        self, in_channels: int, num_classes: int, width_mult: float = 1.0, head_channels: int = 256
    ) -> None:
        super().__init__()
        cin = max(8, int(32 * width_mult))
        layers: list[nn.Module] = [_conv(in_channels, cin, 3)]
        for t, c, n, s in _BLOCKS:
            cout = max(8, int(c * width_mult))
            for i in range(n):
                layers.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        layers.append(_conv(cin, head_channels, 1))
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(head_channels, num_classes)
        )
        self._init_weights()

    def _init_weights(self) -> None:
        """MobileNetV2's own initialisation, as torchvision's.

        He-normal over fan-out for the convolutions, N(0, 0.01) for the classifier. With torch's
        defaults the network sits near chance for its first few dozen SGD steps, which is most
        of a short federated run.
        """
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out")
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, 0.01)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, channels, h, w) -> (batch, num_classes) logits."""
        return self.head(self.features(x))  # type: ignore[no-any-return]
