"""The model zoo that tests and benchmarks share: models, their batches and losses, by name.

- ``ZOO`` (``entries.py``): the tests' small, activation-heavy models by name, with batch
  makers and losses; ``EQUIVALENCE_MODELS`` and the held-out ``HELD_OUT_MODELS``.
- ``workloads()`` (``workloads.py``): the benchmarks' MobileNetV2, ResNet-18 and char GPT at
  full or CI size.
- The models themselves: image classifiers in ``images.py``, language models in
  ``language.py``, the deep MLP in ``dense.py``.

Import from here: ``from benchmarks.zoo import ZOO, workloads``.
"""

from benchmarks.zoo.batches import (
    Batch,
    classification_loss,
    classify,
    image_batch,
    lm_loss,
    next_token,
    round_images,
    round_tokens,
    step_tokens,
    token_batch,
)
from benchmarks.zoo.dense import DeepMLP
from benchmarks.zoo.entries import EQUIVALENCE_MODELS, HELD_OUT_MODELS, ZOO, ZooEntry
from benchmarks.zoo.images import (
    BasicBlock,
    InvertedResidual,
    MixerBlock,
    MLPMixer,
    MobileNetV2,
    ResNet18,
    SmallBasicBlock,
    SmallResNet,
    build_cnn,
)
from benchmarks.zoo.language import (
    CharGPT,
    CharGPTAttention,
    CharGPTBlock,
    LSTMLanguageModel,
    SdpaBlock,
    SdpaGPT,
    SelfAttention,
    TiedEmbeddingLM,
    TinyTransformerLM,
    TransformerBlock,
)
from benchmarks.zoo.workloads import Workload, workloads

__all__ = [
    "EQUIVALENCE_MODELS",
    "HELD_OUT_MODELS",
    "ZOO",
    "BasicBlock",
    "Batch",
    "CharGPT",
    "CharGPTAttention",
    "CharGPTBlock",
    "DeepMLP",
    "InvertedResidual",
    "LSTMLanguageModel",
    "MLPMixer",
    "MixerBlock",
    "MobileNetV2",
    "ResNet18",
    "SdpaBlock",
    "SdpaGPT",
    "SelfAttention",
    "SmallBasicBlock",
    "SmallResNet",
    "TiedEmbeddingLM",
    "TinyTransformerLM",
    "TransformerBlock",
    "Workload",
    "ZooEntry",
    "build_cnn",
    "classification_loss",
    "classify",
    "image_batch",
    "lm_loss",
    "next_token",
    "round_images",
    "round_tokens",
    "step_tokens",
    "token_batch",
    "workloads",
]
