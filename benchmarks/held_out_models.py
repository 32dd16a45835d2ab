"""The held-out benchmark's models: built here and used by no test (``benchmarks/held_out.py``).

Each has a pattern the test zoo lacks: a DenseNet (each layer takes the list of all earlier
features, which its caller then extends), squeeze-and-excitation gating (SiLU, Hardswish, sigmoid
scales), a ConvNeXt (depthwise 7x7, LayerNorm over channels-last, GELU, layer scale, stochastic
depth drawn from torch's generator), a ViT with ``nn.MultiheadAttention`` (self-attention: the
same tensor as query, key and value; dropout), a two-layer GRU language model, a small U-Net
(skip concatenation, transposed convolution, in-place ReLU), a ResNet of basic blocks
(BatchNorm, projection shortcuts), a vision transformer of ``nn.TransformerEncoderLayer``
(torch's fused encoder layer, dropout), and an MLP-Mixer (token mixing across a transposed
sequence). Each model keeps the blocks a user would wrap in ``torch.utils.checkpoint`` in
``blocks``.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class DenseLayer(nn.Module):
    def __init__(self, c: int, growth: int) -> None:
        super().__init__()
        self.bn, self.conv = nn.BatchNorm2d(c), nn.Conv2d(c, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        return self.conv(F.relu(self.bn(torch.cat(features, 1))))


class DenseNet(nn.Module):
    def __init__(self, layers: int = 6, growth: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.blocks = nn.ModuleList(DenseLayer(32 + growth * i, growth) for i in range(layers))
        self.head = nn.Linear(32 + growth * layers, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [self.stem(x)]
        for layer in self.blocks:
            features.append(layer(features))  # the list the layer was given grows afterwards
        return self.head(torch.cat(features, 1).mean((2, 3)))


class SEBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.fc1, self.fc2 = nn.Linear(c, c // 4), nn.Linear(c // 4, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.silu(self.bn(self.conv(x)))
        scale = torch.sigmoid(self.fc2(F.silu(self.fc1(y.mean((2, 3))))))
        return x + y * scale[:, :, None, None]


class SENet(nn.Module):
    def __init__(self, c: int = 48, depth: int = 6) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList(SEBlock(c) for _ in range(depth))
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.hardswish(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


class NeXtBlock(nn.Module):
    def __init__(self, c: int, drop: float) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(c), nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.full((c,), 0.1))
        self.drop = drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(x).permute(0, 2, 3, 1)
        y = (self.fc2(F.gelu(self.fc1(self.norm(y)))) * self.gamma).permute(0, 3, 1, 2)
        if self.training and self.drop > 0:  # stochastic depth, from torch's generator
            keep = (torch.rand(x.shape[0], 1, 1, 1) > self.drop).to(y.dtype) / (1 - self.drop)
            y = y * keep
        return x + y


class ConvNeXt(nn.Module):
    def __init__(self, c: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 4, stride=4)
        self.blocks = nn.ModuleList(NeXtBlock(c, 0.1) for _ in range(depth))
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


class ViTBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, d)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]  # self-attention: query is key
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, d: int = 96, depth: int = 4) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, 8, stride=8)
        self.pos = nn.Parameter(torch.zeros(1, 64, d))
        self.blocks = nn.ModuleList(ViTBlock(d) for _ in range(depth))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


class GRUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 64)
        self.gru = nn.GRU(64, 128, 2, batch_first=True, dropout=0.1)
        self.head = nn.Linear(128, 64)
        self.blocks = nn.ModuleList([self.gru])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.emb(x))[0])


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True))
        self.down2 = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(inplace=True))
        self.mid = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.out = nn.Conv2d(32, 10, 3, padding=1)
        self.blocks = nn.ModuleList([self.down1, self.down2, self.mid, self.up, self.out])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.down1(x)
        u = F.interpolate(self.up(self.mid(self.down2(a))), size=a.shape[-2:])
        return self.out(torch.cat([a, u], 1)).mean((2, 3))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b2(self.c2(F.relu(self.b1(self.c1(x)))))
        return F.relu(y + self.short(x))


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU()
        )
        widths = [(32, 32, 1), (32, 32, 1), (32, 64, 2), (64, 64, 1), (64, 128, 2), (128, 128, 1)]
        self.blocks = nn.ModuleList(BasicBlock(*w) for w in widths)
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


class Tokens(nn.Module):
    """Patches embedded as a sequence of tokens, a stack of blocks, mean-pooled into the head."""

    def __init__(self, patch: int, d: int, block: Callable[[], nn.Module], depth: int) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, d, patch, patch)
        self.blocks = nn.ModuleList(block() for _ in range(depth))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


def encoder_vit(d: int = 128, depth: int = 4) -> nn.Module:
    """torch's own encoder layers: its fused path, with dropout."""
    return Tokens(
        8, d, lambda: nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.1, batch_first=True), depth
    )


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, d: int) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.tokens = nn.Sequential(
            nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens)
        )
        self.channels = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.tokens(self.n1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.n2(x))


def mixer(d: int = 96, depth: int = 4) -> nn.Module:
    """An MLP-Mixer over a 64 px image's 16x16 patches of 4 px."""
    return Tokens(4, d, lambda: MixerBlock(256, d), depth)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "densenet": DenseNet,
    "senet": SENet,
    "convnext": ConvNeXt,
    "vit": ViT,
    "gru": GRUNet,
    "unet": UNet,
    "resnet": ResNet,
    "encoder_vit": encoder_vit,
    "mixer": mixer,
}
