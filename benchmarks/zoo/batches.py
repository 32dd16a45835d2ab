"""Inputs, targets and losses of the zoo's models; every batch comes from its own seeded generator.

No batch maker reads or advances the global RNG. The tests' makers take ``(batch_size, seed)``;
the benchmarks' are sized once and then take a round (or step) index as their seed.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Batch = tuple[Tensor, Tensor]


# -- losses ---------------------------------------------------------------------------------------
def classification_loss(outputs: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy of ``(batch, classes)`` logits against class indices."""
    return F.cross_entropy(outputs, targets)


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Next-token cross-entropy: ``logits`` (batch, seq, vocab) against ``targets`` (batch, seq)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def classify(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """``classification_loss`` of ``model(x)``: a benchmark workload's loss."""
    return classification_loss(model(x), y)


def next_token(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """``lm_loss`` of ``model(x)``: a benchmark workload's loss."""
    return lm_loss(model(x), y)


# -- the tests' batches: (batch_size, seed) -> batch ----------------------------------------------
def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(10_000 + seed)


def image_batch(batch_size: int, seed: int = 0, *, num_classes: int = 10) -> Batch:
    """32x32 RGB images and class labels."""
    gen = _generator(seed)
    images = torch.randn(batch_size, 3, 32, 32, generator=gen)
    labels = torch.randint(0, num_classes, (batch_size,), generator=gen)
    return images, labels


def token_batch(batch_size: int, seed: int = 0, *, vocab: int, seq_len: int) -> Batch:
    """Next-token prediction: targets are the inputs shifted by one position."""
    gen = _generator(seed)
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def token_batches(vocab: int, seq_len: int) -> Callable[..., Batch]:
    """``token_batch`` with its vocabulary and length fixed: ``make(batch_size, seed=0)``."""

    def make_batch(batch_size: int, seed: int = 0) -> Batch:
        return token_batch(batch_size, seed, vocab=vocab, seq_len=seq_len)

    return make_batch


# -- the benchmarks' batches: round index -> batch ------------------------------------------------
def round_images(batch: int, image: int, classes: int) -> Callable[[int], Batch]:
    """``make(round_index)``: ``batch`` RGB images of ``image`` px and labels of ``classes``."""

    def make(round_index: int) -> Batch:
        gen = torch.Generator().manual_seed(1000 + round_index)
        return (
            torch.randn(batch, 3, image, image, generator=gen),
            torch.randint(0, classes, (batch,), generator=gen),
        )

    return make


def round_tokens(batch: int, context: int, vocab: int) -> Callable[[int], Batch]:
    """``make(round_index)``: ``batch`` sequences of ``context`` tokens and their next tokens."""

    def make(round_index: int) -> Batch:
        gen = torch.Generator().manual_seed(1000 + round_index)
        seq = torch.randint(0, vocab, (batch, context + 1), generator=gen)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    return make


def step_tokens(vocab: int, batch: int, seq: int, step: int) -> Batch:
    """The batch of training step ``step`` for the SDPA GPT (seeded by the step; views, no copy)."""
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]
