"""The tests' zoo: small, activation-heavy models by name, with their batches and losses.

Each entry builds a model whose saved activations are several MiB per step at its default batch
size, while one forward and backward takes well under 0.5 s on one CPU thread. Parameters are
small next to activations, so a budget at half the unmanaged peak forces real swapping.

Models are deterministic given ``torch.manual_seed`` before ``build()``; batches come from a
private generator, so ``make_batch`` neither reads nor advances the global RNG.
"""

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from benchmarks.zoo.batches import (
    Batch,
    classification_loss,
    image_batch,
    lm_loss,
    token_batches,
)
from benchmarks.zoo.images import MLPMixer, SmallResNet, build_cnn
from benchmarks.zoo.language import (
    LSTM_SEQ_LEN,
    LSTM_VOCAB,
    TIED_SEQ_LEN,
    TIED_VOCAB,
    TRANSFORMER_SEQ_LEN,
    TRANSFORMER_VOCAB,
    LSTMLanguageModel,
    TiedEmbeddingLM,
    TinyTransformerLM,
)


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


ZOO: dict[str, ZooEntry] = {
    entry.name: entry
    for entry in (
        ZooEntry(
            name="cnn",
            build=build_cnn,
            make_batch=image_batch,
            loss=classification_loss,
            batch_size=8,
            description="conv-bn-relu x4, max-pooling: BatchNorm buffers, large conv activations",
        ),
        ZooEntry(
            name="resnet",
            build=SmallResNet,
            make_batch=image_batch,
            loss=classification_loss,
            batch_size=8,
            description="three basic blocks: skip connections keep tensors alive across layers",
        ),
        ZooEntry(
            name="transformer",
            build=TinyTransformerLM,
            make_batch=token_batches(TRANSFORMER_VOCAB, TRANSFORMER_SEQ_LEN),
            loss=lm_loss,
            batch_size=8,
            description="hand-written attention with softmax, dropout p=0.1, LayerNorm, GELU MLP",
        ),
        ZooEntry(
            name="lstm",
            build=LSTMLanguageModel,
            make_batch=token_batches(LSTM_VOCAB, LSTM_SEQ_LEN),
            loss=lm_loss,
            batch_size=32,
            description="2-layer nn.LSTM: one large saved workspace per layer, MLP head",
        ),
        ZooEntry(
            name="tied",
            build=TiedEmbeddingLM,
            make_batch=token_batches(TIED_VOCAB, TIED_SEQ_LEN),
            loss=lm_loss,
            batch_size=32,
            description="embedding and output projection share a Parameter; in-place ReLU",
        ),
        ZooEntry(
            name="mixer",
            build=MLPMixer,
            make_batch=image_batch,
            loss=classification_loss,
            batch_size=8,
            description="MLP-Mixer: held out, no other test uses it",
        ),
    )
}

# The models the equivalence test runs; "mixer" is kept out of every test as a held-out check.
EQUIVALENCE_MODELS: tuple[str, ...] = ("cnn", "resnet", "transformer", "lstm", "tied")
HELD_OUT_MODELS: tuple[str, ...] = ("mixer",)
