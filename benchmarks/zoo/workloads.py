"""The benchmarks' training workloads: a MobileNetV2, a ResNet-18 and a char GPT, sized to run.

Each ``Workload`` is a model with its batch maker (seeded by the round index) and its loss; the
sizes are the full ones or, with ``quick``, CI-sized ones whose figures are not results.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from benchmarks.zoo.batches import Batch, classify, next_token, round_images, round_tokens
from benchmarks.zoo.images import MobileNetV2, ResNet18
from benchmarks.zoo.language import CharGPT


@dataclass(frozen=True)
class Workload:
    """A model with its batch maker and loss; ``describe`` is printed with the results."""

    name: str
    describe: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], Batch]  # round index -> (inputs, targets), seeded by the index
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


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
            round_images(cnn[0], cnn[1], 1000),
            classify,
        ),
        "resnet": Workload(
            "resnet",
            f"ResNet-18 (base width {res[2]}), {res[1]} px, batch {res[0]}, {res[3]} classes",
            lambda: ResNet18(res[3], res[2]),
            round_images(res[0], res[1], res[3]),
            classify,
        ),
        "gpt": Workload(
            "gpt",
            f"char GPT, {gpt[3]} layers, d={gpt[2]}, 4 heads, T={gpt[1]}, batch {gpt[0]}, "
            "vocab 128",
            lambda: CharGPT(128, gpt[2], 4, gpt[3], gpt[1]),
            round_tokens(gpt[0], gpt[1], 128),
            next_token,
        ),
    }
