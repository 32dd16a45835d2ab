"""What a recomputation costs beyond the unit's own ops, measured once per process and device.

NOTE [mechanism cost]
The profile times a unit's forward (NOTE [unit time] in ``activations/units.py``) and, for
selective recomputation, its ops (NOTE [dispatch cost] in ``activations/selective_profile.py``).
The mechanism that runs it again has a cost of its own, whatever the unit: behind one node
(NOTE [one-node recomputation] in ``activations/rebuild.py``) the node itself, the call's
snapshot, the RNG and autocast state kept and restored, and a nested run of autograd's engine
over the rebuilt graph; under torch's checkpointing its frame, its saved-tensor hooks and
their handles; with the product ops' outputs kept (NOTE [cached products] in
``activations/product_cache.py``), a dispatch mode in force inside each product leaf's call,
in both runs.
Left out, a unit's predicted cost was its forward alone: on the main job's CNN 0.2-1.9 ms a
block where recomputing one added 0.9-3.6 ms to the step (benchmarks/README.md,
``recompute_cost``), so the cheapest cover of a deficit took many small units (ten blocks
selectively on the smallest class's budget), which the race then timed slower than two blocks
whole.

So each mechanism's cost is measured here on a unit too small for its ops to count (a few
1x1 convolutions on a 2x2 input), trained a step at a time with and without it, the variants
in turn, the median of each kept; the profile adds it to what each unit's recomputation is
predicted to cost (``TraceUnit.overhead_s``, and within ``selective_s``). On this machine's
CPU: 0.2 ms behind one node, 0.26-0.28 ms under checkpointing, 0.05 ms a product op answered.
It runs once per process and device, outside any step (no manager's hooks are in force then),
in about 0.1 s on a CPU.
"""

import functools
import statistics
from dataclasses import dataclass

import torch
from torch import nn

from vtensor.activations.rebuild import Boundaries
from vtensor.activations.recompute import recompute_modules
from vtensor.measure.clock import device_now

_ROUNDS = 40  # timed steps per variant, after ``_WARM`` untimed ones
_WARM = 5
_CALLS = 3  # convolutions in the larger of the two small units


@dataclass(frozen=True)
class MechanismCosts:
    """Seconds a recomputation costs beyond its unit's ops (NOTE [mechanism cost]).

    Attributes:
        one_node_s: a unit recomputed whole behind one node, or selectively with its
            product leaves' outputs kept.
        checkpoint_s: a unit recomputed under torch's checkpointing, whole or selectively.
        cached_call_s: each product op answered from what the first run kept (a convolution
            module's call: the mode entered twice, the op dispatched through it twice).
    """

    one_node_s: float
    checkpoint_s: float
    cached_call_s: float


class PlainHost:
    """What ``recompute_modules`` tells that a forward runs again: no manager, no plan."""

    recomputing = 0
    boundaries: Boundaries | None = None  # no module hooks

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
    units = {k: _small_unit(k, at) for k in (1, _CALLS)}
    x = torch.ones(1, 2, 2, 2, device=at, requires_grad=True)
    # (units, calls in the unit, recomputed, selectively, behind one node)
    variants: dict[str, tuple[int, list[str], list[str], list[str]]] = {
        "plain": (1, [], [], []),
        "one node": (1, ["0"], [], ["0"]),
        "checkpoint": (1, ["0"], [], []),
        "cached": (1, ["0"], ["0"], ["0"]),
        "plain, more calls": (_CALLS, [], [], []),
        "cached, more calls": (_CALLS, ["0"], ["0"], ["0"]),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.enable_grad():
        for i in range(_WARM + _ROUNDS):
            for name, (calls, names, selective, one_node) in variants.items():
                model = units[calls]
                with recompute_modules(model, names, host, selective, one_node=one_node):
                    took = _timed_step(model, x)
                if i >= _WARM:
                    times[name].append(took)
    median = {name: statistics.median(t) for name, t in times.items()}
    cached_one = median["cached"] - median["plain"]
    cached_more = median["cached, more calls"] - median["plain, more calls"]
    per_call = max(0.0, (cached_more - cached_one) / (_CALLS - 1))
    return MechanismCosts(
        one_node_s=max(0.0, median["one node"] - median["plain"]),
        checkpoint_s=max(0.0, median["checkpoint"] - median["plain"]),
        cached_call_s=per_call,
    )


def _small_unit(calls: int, device: torch.device) -> nn.Module:
    """A model whose one unit (``"0"``) runs ``calls`` 1x1 convolutions on two channels."""
    layers = [nn.Conv2d(2, 2, 1) for _ in range(calls)]
    return nn.Sequential(nn.Sequential(*layers)).to(device)


def _timed_step(model: nn.Module, x: torch.Tensor) -> float:
    began = device_now(x.device)
    model(x).sum().backward()
    return device_now(x.device) - began
