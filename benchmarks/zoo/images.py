"""Image classifiers: the tests' small 32 px models and the benchmarks' ImageNet-layout CNNs.

The tests' models (``build_cnn``, ``SmallResNet``, ``MLPMixer``) save several MiB of activations
per step at batch 8 and take well under 0.5 s a step on one CPU thread. The benchmarks'
(``MobileNetV2``, ``ResNet18``) use the ImageNet layouts (BatchNorm, standard strides) and can
checkpoint their blocks (``checkpoint_blocks = True``). ``edgefl.models`` holds the federated
models (GroupNorm, strides for 28-32 px inputs).
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.zoo.blocks import run_blocks


# -- the tests' CNN with BatchNorm ----------------------------------------------------------------
def _conv_bn_relu(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]


def build_cnn() -> nn.Module:
    """conv-bn-relu x4 at 32x32 with 16 channels, max-pooling, one linear classifier.

    Equal widths keep any one op's working set (batch-norm backward: input, output gradient and
    input gradient) small next to the step's peak, so half the peak is a feasible budget.
    """
    return nn.Sequential(
        *_conv_bn_relu(3, 16),
        *_conv_bn_relu(16, 16),
        *_conv_bn_relu(16, 16),
        *_conv_bn_relu(16, 16),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 16 * 16, 10),
    )


# -- the tests' residual network ------------------------------------------------------------------
class SmallBasicBlock(nn.Module):
    """ResNet basic block: two conv-bn and a skip (a 1x1 projection when the shape changes).

    Its layers are direct children and its ReLUs functional, unlike ``BasicBlock``'s.
    """

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    """Stem conv, three basic blocks (16, 32/2, 32 channels), global average pool, classifier."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn_relu(3, 16))
        self.blocks = nn.Sequential(
            SmallBasicBlock(16, 16, 1), SmallBasicBlock(16, 32, 2), SmallBasicBlock(32, 32, 1)
        )
        self.head = nn.Linear(32, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out = self.blocks(self.stem(x))
        return self.head(out.mean(dim=(2, 3)))


# -- the tests' held-out model: MLP-Mixer ---------------------------------------------------------
class MixerBlock(nn.Module):
    """Token-mixing MLP across patches, then channel-mixing MLP, each pre-norm with a skip."""

    def __init__(self, num_patches: int, dim: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(
            nn.Linear(num_patches, 2 * num_patches),
            nn.GELU(),
            nn.Linear(2 * num_patches, num_patches),
        )
        self.ln2 = nn.LayerNorm(dim)
        self.channel_mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
        )

    def forward(self, x: Tensor) -> Tensor:
        # x: (batch, patches, dim)
        x = x + self.token_mlp(self.ln1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.ln2(x))


class MLPMixer(nn.Module):
    """4x4 patches of a 32x32 image (64 patches), four mixer blocks, mean-pooled classifier."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        dim, patch = 64, 4
        num_patches = (32 // patch) ** 2
        self.patchify = nn.Conv2d(3, dim, patch, stride=patch)
        self.blocks = nn.Sequential(*(MixerBlock(num_patches, dim) for _ in range(4)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, images: Tensor) -> Tensor:
        x = self.patchify(images).flatten(2).transpose(1, 2)  # (batch, 64 patches, dim)
        return self.head(self.ln(self.blocks(x)).mean(dim=1))


# -- the benchmarks' MobileNetV2 ------------------------------------------------------------------
_MOBILENET = (  # (expansion t, channels c, repeats n, first stride s): ImageNet strides
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def _conv_bn(
    cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: nn.Module | None = None
) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    ]
    if act is not None:
        layers.append(act)
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """1x1 expand -> 3x3 depthwise -> 1x1 linear projection, with a skip when shapes allow."""

    def __init__(self, cin: int, cout: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = cin * expansion
        layers: list[nn.Module] = (
            [] if expansion == 1 else [_conv_bn(cin, hidden, 1, act=nn.ReLU6())]
        )
        layers += [
            _conv_bn(hidden, hidden, 3, stride, groups=hidden, act=nn.ReLU6()),
            _conv_bn(hidden, cout, 1),
        ]
        self.body = nn.Sequential(*layers)
        self.skip = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return x + out if self.skip else out  # type: ignore[no-any-return]


class MobileNetV2(nn.Module):
    """MobileNetV2 (Sandler et al. 2018): activation-heavy (x6 expanded 3x3 depthwise stages)."""

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0) -> None:
        super().__init__()
        cin = max(8, int(32 * width_mult))
        self.stem = _conv_bn(3, cin, 3, stride=2, act=nn.ReLU6())
        blocks: list[nn.Module] = []
        for t, c, n, s in _MOBILENET:
            cout = max(8, int(c * width_mult))
            for i in range(n):
                blocks.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        self.blocks = nn.ModuleList(blocks)
        self.last = _conv_bn(cin, 1280, 1, act=nn.ReLU6())
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1280, num_classes)
        )
        self.checkpoint_blocks = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = run_blocks(self.blocks, self.stem(x), self.checkpoint_blocks)
        return self.head(self.last(x))  # type: ignore[no-any-return]


# -- the benchmarks' ResNet-18 --------------------------------------------------------------------
class BasicBlock(nn.Module):
    """Two 3x3 conv-BN stages with an identity (or 1x1 projection) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            _conv_bn(cin, cout, 3, stride, act=nn.ReLU()), _conv_bn(cout, cout, 3)
        )
        self.shortcut = (
            nn.Identity() if stride == 1 and cin == cout else _conv_bn(cin, cout, 1, stride)
        )
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.body(x) + self.shortcut(x))  # type: ignore[no-any-return]


class ResNet18(nn.Module):
    """ResNet-18 (He et al. 2016), ImageNet layout: 7x7/2 stem, 3x3/2 max-pool, 4 stages of 2."""

    def __init__(self, num_classes: int = 1000, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, 2, 3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )
        blocks: list[nn.Module] = []
        cin = width
        for stage in range(4):
            cout = width * 2**stage
            blocks += [BasicBlock(cin, cout, 1 if stage == 0 else 2), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)
        )
        self.checkpoint_blocks = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = run_blocks(self.blocks, self.stem(x), self.checkpoint_blocks)
        return self.head(x)  # type: ignore[no-any-return]
