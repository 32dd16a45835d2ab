"""A small GPT-style character model: learned positions, pre-norm causal attention blocks."""

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention through ``scaled_dot_product_attention``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, time, dim) -> (batch, time, dim)."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, d/heads)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))  # type: ignore[no-any-return]


class Block(nn.Module):
    """x + attn(ln(x)); x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-norm residual block."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class CharGPT(nn.Module):
    """Decoder-only LM over a character vocabulary; returns (batch, time, vocab) logits."""

    def __init__(
        self, vocab_size: int, seq_len: int, dim: int = 128, layers: int = 2, heads: int = 4
    ) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"char_gpt dim={dim} must be divisible by heads={heads}")
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, dim))
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, time) token ids -> (batch, time, vocab) logits."""
        h = self.tok(x) + self.pos[:, : x.shape[1]]
        return self.head(self.ln(self.blocks(h)))  # type: ignore[no-any-return]
