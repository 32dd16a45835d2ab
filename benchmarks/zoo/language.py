"""Language models: the tests' small ones and the benchmarks' char GPT and SDPA GPT.

Three transformer families live here and stay apart, because their modules differ and the
memory manager hooks modules: ``TinyTransformerLM`` (the tests'; attention written out with
dropout), ``CharGPT`` (the activation-swap workloads'; attention written out, so autograd saves
the T x T probabilities; blocks can be checkpointed) and ``SdpaGPT`` (the parameter-offload
benchmarks'; scaled-dot-product attention, tied embedding and head).
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.zoo.blocks import run_blocks

# -- the tests' transformer -----------------------------------------------------------------------
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


# -- the tests' LSTM ------------------------------------------------------------------------------
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


# -- the tests' tied weights and in-place ReLU ----------------------------------------------------
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


# -- the benchmarks' char GPT ---------------------------------------------------------------------
class CharGPTAttention(nn.Module):
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


class CharGPTBlock(nn.Module):
    """Pre-norm block: x + attn(ln(x)), then x + mlp(ln(x)) with a 4x GELU MLP; no dropout."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CharGPTAttention(d_model, heads)
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
        self.blocks = nn.ModuleList(CharGPTBlock(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.checkpoint_blocks = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        x = run_blocks(self.blocks, x, self.checkpoint_blocks)
        return self.head(self.ln(x))  # type: ignore[no-any-return]


# -- the parameter-offload benchmarks' GPT --------------------------------------------------------
class SdpaBlock(nn.Module):
    """Pre-norm transformer block with causal scaled-dot-product attention and a GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(batch, seq, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        out: Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


class SdpaGPT(nn.Module):
    """Token embedding tied to the output head, learned positions, ``depth`` SDPA blocks."""

    def __init__(self, vocab: int, dim: int, depth: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.Sequential(*(SdpaBlock(dim, dim // 64) for _ in range(depth)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.blocks(self.tok(tokens) + self.pos[: tokens.shape[1]])
        logits: Tensor = self.head(self.ln(h))
        return logits
