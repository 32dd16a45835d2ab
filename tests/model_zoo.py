"""Small, activation-heavy models and input factories for memory-manager equivalence tests.

Each entry builds a model whose saved activations are several MiB per step at its default batch
size, while one forward and backward takes well under 0.5 s on one CPU thread. Parameters are
small next to activations, so a budget at half the unmanaged peak forces real swapping.

Models are deterministic given ``torch.manual_seed`` before ``build()``; batches come from a
private generator, so ``make_batch`` neither reads nor advances the global RNG.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Batch = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class ZooEntry:
    """One model of the zoo.

    Attributes:
        name: short id, used in pytest ids.
        build: makes a fresh model; deterministic given ``torch.manual_seed``.
        make_batch: ``make_batch(batch_size, seed=0) -> (inputs, targets)``; deterministic in
            ``seed``, independent of the global RNG.
        loss: ``loss(outputs, targets) -> scalar tensor``.
        batch_size: the batch size the model is sized for.
        description: what the model exercises.
    """

    name: str
    build: Callable[[], nn.Module]
    make_batch: Callable[..., Batch]
    loss: Callable[[Tensor, Tensor], Tensor]
    batch_size: int
    description: str


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(10_000 + seed)


def _image_batch(batch_size: int, seed: int = 0, *, num_classes: int = 10) -> Batch:
    gen = _generator(seed)
    images = torch.randn(batch_size, 3, 32, 32, generator=gen)
    labels = torch.randint(0, num_classes, (batch_size,), generator=gen)
    return images, labels


def _token_batch(batch_size: int, seed: int = 0, *, vocab: int, seq_len: int) -> Batch:
    """Next-token prediction: targets are the inputs shifted by one position."""
    gen = _generator(seed)
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _classification_loss(outputs: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(outputs, targets)


def _lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    # logits: (batch, seq, vocab); targets: (batch, seq)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# (a) CNN with BatchNorm ---------------------------------------------------------------------


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


# (b) residual network -----------------------------------------------------------------------


class BasicBlock(nn.Module):
    """ResNet basic block: two conv-bn and a skip (a 1x1 projection when the shape changes)."""

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


class ResNet(nn.Module):
    """Stem conv, three basic blocks (16, 32/2, 32 channels), global average pool, classifier."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn_relu(3, 16))
        self.blocks = nn.Sequential(
            BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 32, 1)
        )
        self.head = nn.Linear(32, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out = self.blocks(self.stem(x))
        return self.head(out.mean(dim=(2, 3)))


# (c) transformer ----------------------------------------------------------------------------

TRANSFORMER_VOCAB = 256
TRANSFORMER_SEQ_LEN = 64


class SelfAttention(nn.Module):
    """Multi-head self-attention written out: scores, causal mask, softmax, dropout on weights."""

    def __init__(self, dim: int, heads: int, dropout_p: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(dropout_p)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, dim = x.shape
        # (batch, seq, 3*dim) -> 3 x (batch, heads, seq, head_dim)
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        weights = self.attn_drop(scores.masked_fill(causal, float("-inf")).softmax(dim=-1))
        out = (weights @ v).transpose(1, 2).reshape(batch, seq, dim)
        return self.proj(out)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + drop(attn(ln(x))), then x + drop(mlp(ln(x)))."""

    def __init__(self, dim: int, heads: int, dropout_p: float = 0.1) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, dropout_p)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout_p)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyTransformerLM(nn.Module):
    """Token + position embedding, two transformer blocks, final LayerNorm, vocabulary head."""

    def __init__(self, vocab: int = TRANSFORMER_VOCAB, seq_len: int = TRANSFORMER_SEQ_LEN) -> None:
        super().__init__()
        dim = 64
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        self.blocks = nn.Sequential(TransformerBlock(dim, 4), TransformerBlock(dim, 4))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.ln(self.blocks(x)))


# (d) LSTM -----------------------------------------------------------------------------------

LSTM_VOCAB = 128
LSTM_SEQ_LEN = 64


class LSTMLanguageModel(nn.Module):
    """Embedding, 2-layer nn.LSTM, MLP head over the vocabulary.

    On CPU each LSTM layer is one op (oneDNN) that saves a workspace of ~20 floats per hidden
    unit and token; the hidden size is kept small and the head deep so that one layer's backward
    stays well under half the step's peak.
    """

    def __init__(self, vocab: int = LSTM_VOCAB) -> None:
        super().__init__()
        hidden, width = 32, 192
        self.embed = nn.Embedding(vocab, 32)
        self.lstm = nn.LSTM(32, hidden, num_layers=2, batch_first=True)
        self.head = nn.Sequential(
            nn.Linear(hidden, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, vocab),
        )  # fmt: skip

    def forward(self, tokens: Tensor) -> Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out)


# (e) tied weights and in-place ReLU ---------------------------------------------------------

TIED_VOCAB = 128
TIED_SEQ_LEN = 64


class TiedEmbeddingLM(nn.Module):
    """Embedding and output projection share one Parameter; residual MLPs use in-place ReLU."""

    def __init__(self, vocab: int = TIED_VOCAB) -> None:
        super().__init__()
        dim, width = 64, 192
        self.embed = nn.Embedding(vocab, dim)
        # Unit-variance rows would give logits of size ~dim through the tied projection.
        nn.init.normal_(self.embed.weight, std=dim**-0.5)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Linear(dim, width),
                nn.ReLU(inplace=True),
                nn.Linear(width, dim),
                nn.ReLU(inplace=True),
            )
            for _ in range(4)
        )
        self.out_bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        # The same Parameter as the embedding: its gradient accumulates from both uses.
        return F.linear(h, self.embed.weight, self.out_bias)


# (f) held out: MLP-Mixer --------------------------------------------------------------------


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


def _tokens(vocab: int, seq_len: int) -> Callable[..., Batch]:
    def make_batch(batch_size: int, seed: int = 0) -> Batch:
        return _token_batch(batch_size, seed, vocab=vocab, seq_len=seq_len)

    return make_batch


ZOO: dict[str, ZooEntry] = {
    entry.name: entry
    for entry in (
        ZooEntry(
            name="cnn",
            build=build_cnn,
            make_batch=_image_batch,
            loss=_classification_loss,
            batch_size=8,
            description="conv-bn-relu x4, max-pooling: BatchNorm buffers, large conv activations",
        ),
        ZooEntry(
            name="resnet",
            build=ResNet,
            make_batch=_image_batch,
            loss=_classification_loss,
            batch_size=8,
            description="three basic blocks: skip connections keep tensors alive across layers",
        ),
        ZooEntry(
            name="transformer",
            build=TinyTransformerLM,
            make_batch=_tokens(TRANSFORMER_VOCAB, TRANSFORMER_SEQ_LEN),
            loss=_lm_loss,
            batch_size=8,
            description="hand-written attention with softmax, dropout p=0.1, LayerNorm, GELU MLP",
        ),
        ZooEntry(
            name="lstm",
            build=LSTMLanguageModel,
            make_batch=_tokens(LSTM_VOCAB, LSTM_SEQ_LEN),
            loss=_lm_loss,
            batch_size=32,
            description="2-layer nn.LSTM: one large saved workspace per layer, MLP head",
        ),
        ZooEntry(
            name="tied",
            build=TiedEmbeddingLM,
            make_batch=_tokens(TIED_VOCAB, TIED_SEQ_LEN),
            loss=_lm_loss,
            batch_size=32,
            description="embedding and output projection share a Parameter; in-place ReLU",
        ),
        ZooEntry(
            name="mixer",
            build=MLPMixer,
            make_batch=_image_batch,
            loss=_classification_loss,
            batch_size=8,
            description="MLP-Mixer: held out, no other test uses it",
        ),
    )
}

# The models the equivalence test runs; "mixer" is kept out of every test as a held-out check.
EQUIVALENCE_MODELS: tuple[str, ...] = ("cnn", "resnet", "transformer", "lstm", "tied")
HELD_OUT_MODELS: tuple[str, ...] = ("mixer",)
