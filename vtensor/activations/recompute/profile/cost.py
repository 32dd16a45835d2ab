"""What a recomputation costs beyond the unit's own ops, measured once per process and device.

NOTE [mechanism cost]
Checkpointing costs something of its own whatever the unit; left out, the cheapest cover takes
many small units, each paying it. So it is measured once on a tiny unit, with and without it
(medians), and added to each unit's cost (``TraceUnit.overhead_s``).
"""

import functools
import statistics
from dataclasses import dataclass

import torch
from torch import nn

from vtensor.activations.recompute.checkpointed import recompute_modules
from vtensor.measure.clock import device_now

_ROUNDS = 40  # timed steps per variant, after ``_WARM`` untimed ones
_WARM = 5


@dataclass(frozen=True)
class MechanismCosts:
    """Seconds a checkpointed recomputation costs beyond its unit's ops (NOTE [mechanism cost])."""

    checkpoint_s: float


class PlainHost:
    """What ``recompute_modules`` tells that a forward runs again: no manager, no plan."""

    recomputing = 0

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def recompute_began(self, regrowth_bytes: int) -> None:
        """Nothing to place."""

    def recompute_ended(self) -> None:
        """Nothing to measure."""


@functools.cache
def mechanism_costs(device: str) -> MechanismCosts:
    """The mechanisms' costs on ``device`` (``"cpu"``, ``"cuda:0"``), measured once per process."""
    at = torch.device(device)
    # The small units' weights come from the RNG: the caller's streams stay as they were.
    devices = [at.index or 0] if at.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=at.type):
        return _measured(at)


def _measured(at: torch.device) -> MechanismCosts:
    host = PlainHost(at)
    model = _small_unit(at)
    x = torch.ones(1, 2, 2, 2, device=at, requires_grad=True)
    times: dict[bool, list[float]] = {False: [], True: []}
    with torch.enable_grad():
        for i in range(_WARM + _ROUNDS):
            for recomputed in (False, True):
                with recompute_modules(model, ["0"] if recomputed else [], host):
                    took = _timed_step(model, x)
                if i >= _WARM:
                    times[recomputed].append(took)
    cost = statistics.median(times[True]) - statistics.median(times[False])
    return MechanismCosts(checkpoint_s=max(0.0, cost))


def _small_unit(device: torch.device) -> nn.Module:
    """A model whose one unit (``"0"``) runs a 1x1 convolution on two channels."""
    return nn.Sequential(nn.Sequential(nn.Conv2d(2, 2, 1))).to(device)


def _timed_step(model: nn.Module, x: torch.Tensor) -> float:
    began = device_now(x.device)
    model(x).sum().backward()
    return device_now(x.device) - began
