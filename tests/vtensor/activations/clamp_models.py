"""A small network of convolution, GroupNorm and ReLU6 for the mask-encoding tests."""

import itertools
from collections.abc import Iterator

import torch
from torch import nn

import vtensor


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def clamp_model() -> nn.Sequential:
    torch.manual_seed(0)

    def block(c: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(4, c), nn.ReLU6())

    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        *[block(16) for _ in range(5)],
        nn.Flatten(),
        nn.Linear(16 * 12 * 12, 10),
    )


def clamp_steps(model: nn.Module, mm: vtensor.MemoryManager | None) -> Iterator[float]:
    """Train ``model`` step after step (batch ``i`` at step ``i``), yielding each step's loss."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i in itertools.count():
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 3, 12, 12, generator=g), torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad(set_to_none=True)
        if mm is None:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
        else:
            with mm.step(model, opt, (x, y)):
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
        opt.step()
        yield loss.item()


def train_clamps(model: nn.Module, mm: vtensor.MemoryManager | None, steps: int) -> list[float]:
    return list(itertools.islice(clamp_steps(model, mm), steps))
