"""Benchmark workloads: a MobileNetV2, a ResNet-18 and a causal char transformer, and their batches.

Each model can checkpoint its blocks (``checkpoint_blocks = True``: ``torch.utils.checkpoint`` per
block, ``use_reentrant=False``), which is the recomputation baseline of the benchmark.
``edgefl.models`` holds the federated models (GroupNorm, strides for 28-32 px inputs); these use
the ImageNet layouts (BatchNorm, standard strides) at 128 px.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _blockwise(blocks: nn.ModuleList, x: torch.Tensor, ckpt: bool) -> torch.Tensor:
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False) if ckpt else block(x)
    return x


# -- MobileNetV2 ----------------------------------------------------------------------------------
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
        x = _blockwise(self.blocks, self.stem(x), self.checkpoint_blocks)
        return self.head(self.last(x))  # type: ignore[no-any-return]


# -- ResNet-18 ------------------------------------------------------------------------------------
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
        x = _blockwise(self.blocks, self.stem(x), self.checkpoint_blocks)
        return self.head(x)  # type: ignore[no-any-return]


# -- char transformer -----------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    """Multi-head causal attention written out, so that autograd saves the T x T probabilities."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))  # (b, h, t, t)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)  # saved: b*h*t*t*4 B
        out = (probs @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(out)  # type: ignore[no-any-return]


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(ln(x)), then x + mlp(ln(x)) with a 4x GELU MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class CharGPT(nn.Module):
    """GPT-style character language model: token + position embeddings, blocks, tied-free head."""

    def __init__(
        self,
        vocab: int = 128,
        d_model: int = 256,
        heads: int = 4,
        layers: int = 4,
        context: int = 512,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.checkpoint_blocks = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        x = _blockwise(self.blocks, x, self.checkpoint_blocks)
        return self.head(self.ln(x))  # type: ignore[no-any-return]


# -- workloads ------------------------------------------------------------------------------------
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Workload:
    """A model with its batch maker and loss; ``describe`` is printed with the results."""

    name: str
    describe: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], Batch]  # round index -> (inputs, targets), seeded by the index
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _images(batch: int, image: int, classes: int) -> Callable[[int], Batch]:
    def make(round_index: int) -> Batch:
        gen = torch.Generator().manual_seed(1000 + round_index)
        return (
            torch.randn(batch, 3, image, image, generator=gen),
            torch.randint(0, classes, (batch,), generator=gen),
        )

    return make


def _tokens(batch: int, context: int, vocab: int) -> Callable[[int], Batch]:
    def make(round_index: int) -> Batch:
        gen = torch.Generator().manual_seed(1000 + round_index)
        seq = torch.randint(0, vocab, (batch, context + 1), generator=gen)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    return make


def _classify(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def _next_char(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def workloads(quick: bool, batch_scale: float = 1.0) -> dict[str, Workload]:
    """The three benchmark workloads, CI-sized when ``quick``; ``batch_scale`` scales batches."""

    def b(n: int) -> int:
        return max(1, round(n * batch_scale))

    if quick:
        cnn, res, gpt = (b(8), 96, 0.5), (b(8), 64, 16, 10), (b(2), 128, 128, 2)
    else:
        cnn, res, gpt = (b(24), 128, 1.0), (b(48), 128, 64, 100), (b(8), 512, 256, 4)
    width = cnn[2]
    return {
        "mobilenet": Workload(
            "mobilenet",
            f"MobileNetV2 x{width}, {cnn[1]} px, batch {cnn[0]}, 1000 classes",
            lambda: MobileNetV2(width_mult=width),
            _images(cnn[0], cnn[1], 1000),
            _classify,
        ),
        "resnet": Workload(
            "resnet",
            f"ResNet-18 (base width {res[2]}), {res[1]} px, batch {res[0]}, {res[3]} classes",
            lambda: ResNet18(res[3], res[2]),
            _images(res[0], res[1], res[3]),
            _classify,
        ),
        "gpt": Workload(
            "gpt",
            f"char GPT, {gpt[3]} layers, d={gpt[2]}, 4 heads, T={gpt[1]}, batch {gpt[0]}, "
            "vocab 128",
            lambda: CharGPT(128, gpt[2], 4, gpt[3], gpt[1]),
            _tokens(gpt[0], gpt[1], 128),
            _next_char,
        ),
    }
