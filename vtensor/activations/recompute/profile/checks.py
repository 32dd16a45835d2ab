"""Whether running a unit's forward again reproduces it: the checks of NOTE [safe to recompute]."""

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vtensor.activations.encode import side_effect_free
from vtensor.activations.recompute.checkpointed import CallSnapshot, RecomputeTarget
from vtensor.measure.clock import device_now
from vtensor.outputs import tensors_in

_SIMPLE = (int, float, bool, str, type(None))
_MAX_GRAPH_NODES = 100_000


@dataclass(frozen=True)
class StartState:
    """What a unit's forward began with: the RNG states and its buffers' values."""

    rng: torch.Tensor
    cuda_rng: torch.Tensor | None
    buffers: list[torch.Tensor]


@contextlib.contextmanager
def replaying(module: nn.Module, start: StartState, target: RecomputeTarget) -> Iterator[None]:
    """Run the forward of ``module`` again from ``start``; the state after it comes back."""
    rng_after = torch.get_rng_state()
    cuda_after = torch.cuda.get_rng_state() if start.cuda_rng is not None else None
    buffers = list(module.buffers())
    buffers_after = [b.detach().clone() for b in buffers]
    target.recomputing += 1
    try:
        torch.set_rng_state(start.rng)
        if start.cuda_rng is not None:
            torch.cuda.set_rng_state(start.cuda_rng)
        with torch.no_grad():
            for buffer, value in zip(buffers, start.buffers, strict=True):
                buffer.copy_(value)
        yield
    finally:
        target.recomputing -= 1
        torch.set_rng_state(rng_after)
        if cuda_after is not None:
            torch.cuda.set_rng_state(cuda_after)
        with torch.no_grad():
            for buffer, value in zip(buffers, buffers_after, strict=True):
                buffer.copy_(value)


@dataclass
class OpenUnit:
    """A unit's forward as it began: what its checks and profile run it again from."""

    first_step: int
    first_vid: int
    started: float
    input_storages: set[int]
    versions: list[tuple[torch.Tensor, int]]
    input_nodes: set[int]
    rng: torch.Tensor
    cuda_rng: torch.Tensor | None
    buffers: list[torch.Tensor]
    attributes: dict[tuple[int, str], object]
    call: CallSnapshot  # what a recomputation would run from (NOTE [call snapshot])
    watch: list[int]  # NOTE [recomputation's working set]


def cuda_rng() -> torch.Tensor | None:
    """The CUDA generator's state where CUDA is in use (None otherwise)."""
    initialized: bool = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    return torch.cuda.get_rng_state() if initialized else None


def plain_attributes(module: nn.Module) -> dict[tuple[int, str], object]:
    """The plain public attributes of ``module`` and its submodules (not tensors or modules)."""
    found: dict[tuple[int, str], object] = {}
    for index, m in enumerate(module.modules()):
        for key, value in vars(m).items():
            if not key.startswith("_") and isinstance(value, _SIMPLE):
                found[(index, key)] = value
    return found


def why_unsafe(
    module: nn.Module, opened: OpenUnit, output: Any, target: RecomputeTarget
) -> tuple[str, float]:
    """Why recomputing ``module`` might not reproduce its forward (""), and its rerun's time."""
    if any(t._version != version for t, version in opened.versions):
        return "it modifies an input in place", 0.0
    outputs = tensors_in(output)
    if _calls_custom_function(outputs, opened.input_nodes):
        return "it calls a custom autograd Function", 0.0
    if plain_attributes(module) != opened.attributes:
        return "it changes a module attribute in its forward", 0.0
    same, again_s = _reproduces(module, opened, outputs, target)
    if not same:
        return "a second forward from the same inputs gave other outputs", again_s
    return "", again_s


def _calls_custom_function(outputs: Sequence[torch.Tensor], stop: set[int]) -> bool:
    stack: list[Any] = [t.grad_fn for t in outputs if t.grad_fn is not None]
    visited: set[int] = set()
    while stack and len(visited) < _MAX_GRAPH_NODES:
        node = stack.pop()
        if node is None or id(node) in visited or id(node) in stop:
            continue
        visited.add(id(node))
        if isinstance(node, torch.autograd.function.BackwardCFunction) and not side_effect_free(
            node
        ):
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def _reproduces(
    module: nn.Module, opened: OpenUnit, outputs: Sequence[torch.Tensor], target: RecomputeTarget
) -> tuple[bool, float]:
    """Whether the forward run again from the call's snapshot gives the same outputs; its time."""
    start = StartState(opened.rng, opened.cuda_rng, opened.buffers)
    args, kwargs = opened.call.copy()
    with replaying(module, start, target), torch.no_grad():
        began = device_now(target.device)
        again = tensors_in(module.forward(*args, **kwargs))
        again_s = device_now(target.device) - began
    same = len(again) == len(outputs) and all(
        same_bits(a, b) for a, b in zip(again, outputs, strict=True)
    )
    del again
    if same:  # timed once more, the least kept (NOTE [unit time])
        args, kwargs = opened.call.copy()
        with replaying(module, start, target), torch.no_grad():
            began = device_now(target.device)
            module.forward(*args, **kwargs)
            again_s = min(again_s, device_now(target.device) - began)
    return same, again_s


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bits (NaNs equal themselves, -0.0 is not 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.dtype.is_floating_point or a.dtype.is_complex:
        # NaNs equal as bits (flattened: a 0-dim tensor has no byte view).
        return torch.equal(_bytes(a), _bytes(b))
    return torch.equal(a, b)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of its element's size (faster to compare than bytes)."""
    flat = t.detach().reshape(-1).contiguous()
    return flat.view(_SAME_SIZE_INT.get(flat.element_size(), torch.uint8))
