"""While profiling: what recomputing a unit selectively would cost, free and keep.

A second run of a safe unit's forward, from the state its forward began with (as the check of
NOTE [safe to recompute] in ``activations/units.py`` does, its time left out of the step's),
under a dispatch mode that times every op and notes the storages product ops make (NOTE
[selective recompute] in ``activations/selective.py``), with autograd on and saved-tensor
hooks that note, in order of first save, which storages autograd saves (and keep none of them).
The forward just reproduced its outputs bit for bit, so its saves come in the same order as the
first forward's: the new storages saved are matched, in order, to the vTensors it made.
"""

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from vtensor.activations.product_cache import product_leaves
from vtensor.activations.recompute import RecomputeTarget
from vtensor.activations.rerun_cost import MechanismCosts
from vtensor.activations.selective import is_product
from vtensor.activations.store import VTensor
from vtensor.measure.clock import device_now
from vtensor.outputs import tensors_in
from vtensor.planner.trace import TraceUnit


class ProfileTarget(RecomputeTarget, Protocol):
    """What the profile asks of the iteration."""

    def manages(self, tensor: torch.Tensor) -> bool:
        """Whether a saved ``tensor`` becomes a vTensor."""
        ...


@dataclass(frozen=True)
class SelectiveProfile:
    """A unit's forward as selective recomputation sees it (store vids).

    Attributes:
        selective_s: what recomputing it selectively costs (NOTE [dispatch cost]).
        product_vids: the vTensors it saved whose storage a product op made.
        products: (vTensor or None where autograd saved none, bytes) per product output.
        why_not: why it may not be recomputed selectively ("" if it may).
        tail_share: the share of its ops' time after its last save (NOTE [one-node
            recomputation] in ``activations/rebuild.py``).
        cached: behind one node, the outputs of the product ops it ran inside calls of its
            convolution and linear modules may be kept instead (NOTE [cached products] in
            ``activations/product_cache.py``), its other product ops run again.
        cached_s: what recomputing it selectively costs that way: its non-product ops, its
            product ops outside those calls and its Python once more, without SAC's dispatch
            mode (a mode in force inside those calls only is the mechanism's cost, NOTE
            [mechanism cost]).
        cached_calls: how many product ops a cache would answer.
        cached_vids: of ``product_vids``, those a cache would keep.
        cached_kept: as ``products``, the product outputs a cache would keep.
    """

    selective_s: float
    product_vids: frozenset[int]
    products: tuple[tuple[int | None, int], ...]
    why_not: str
    tail_share: float = 0.0
    cached: bool = False
    cached_s: float = 0.0
    cached_calls: int = 0
    cached_vids: frozenset[int] = frozenset()
    cached_kept: tuple[tuple[int | None, int], ...] = ()


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


class _OpRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Times each op; keeps the outputs of product ops with their versions when made.

    ``leaf_depth`` is above 0 inside a call of a product leaf (``_Leaves``): the product ops
    run there are those a cache would answer (NOTE [cached products]).
    """

    def __init__(self, tail: list[float]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.other_s = 0.0
        self.ops_s = 0.0
        self.outside_s = 0.0  # product ops run outside the leaves' calls
        self.tail = tail  # [the ops' time since the last save]
        self.products: list[tuple[torch.Tensor, int]] = []
        self.in_leaves: set[int] = set()  # storages product ops made inside the leaves' calls
        self.product_ops = 0
        self.leaf_ops = 0
        self.leaf_depth = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        began = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        took = time.perf_counter() - began
        self.ops_s += took
        self.tail[0] += took
        if is_product(func):
            self.product_ops += 1
            made = tensors_in(out)
            self.products += [(t, t._version) for t in made]
            if self.leaf_depth:
                self.leaf_ops += 1
                self.in_leaves.update(t.untyped_storage()._cdata for t in made)
            else:
                self.outside_s += took
        else:
            self.other_s += took
        return out


def profile_selective(
    module: nn.Module,
    start: StartState,
    call: tuple[Any, Any],
    vids: Sequence[int],
    records: Mapping[int, VTensor],
    target: ProfileTarget,
    plain_s: float,
) -> SelectiveProfile:
    """Run the forward of ``module`` (``call``: its args and kwargs) again and profile it.

    ``vids``: the vTensors its first forward made, in order of first save. ``plain_s``: its
    forward's time run again without autograd or a dispatch mode (NOTE [unit time]).
    """
    saved: list[int] = []  # storages, in order of first save
    # Weak references keep each saved storage's address from being reused by a later one
    # once its tensors are freed (nothing here keeps them), without keeping its bytes.
    seen: dict[int, StorageWeakRef] = {}

    # The pack hook must not reach the recorder: the graph this forward builds keeps its hooks,
    # and the recorder keeps that graph's product outputs, a cycle that no collection frees
    # while a step holds the cycle collector (NOTE [quiet heap]).
    tail = [0.0]
    recorder = _OpRecorder(tail)

    def pack(tensor: torch.Tensor) -> None:
        tail[0] = 0.0  # an op's inputs are saved before it runs, its outputs after
        storage = tensor.untyped_storage()
        if storage._cdata not in seen and target.manages(tensor):
            seen[storage._cdata] = StorageWeakRef(storage)  # type: ignore[no-untyped-call]
            saved.append(storage._cdata)

    args, kwargs = call
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, _never)
    leaves = _Leaves(module, recorder)
    with replaying(module, start, target), torch.enable_grad(), hooks, recorder, leaves:
        began = device_now(target.device)
        again = tensors_in(module.forward(*args, **kwargs))
        wall_s = device_now(target.device) - began
    outputs = {t.untyped_storage()._cdata for t in again}
    known = {r.storage._cdata: v for v, r in records.items() if r.storage is not None}
    mapped = {c: known[c] for c in saved if c in known}  # the same storage: an input
    new = [c for c in saved if c not in known]
    made = [v for v in vids if v not in mapped.values()]
    why = "" if len(new) == len(made) else "a second forward saved other tensors"
    mapped.update(zip(new, made, strict=False))
    sizes = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t, _ in recorder.products}
    if any(t._version != version for t, version in recorder.products):
        why = why or "it modifies a product output in place"
    if any(c in sizes for c in outputs):
        why = why or "a product output leaves it"
    kept = {c: n for c, n in sizes.items() if c in recorder.in_leaves}
    return SelectiveProfile(
        selective_s=selective_cost(recorder.other_s, recorder.ops_s, plain_s, wall_s),
        product_vids=frozenset(mapped[c] for c in sizes if c in mapped),
        products=tuple((mapped.get(c), n) for c, n in sizes.items()),
        why_not=why,
        tail_share=tail[0] / recorder.ops_s if recorder.ops_s > 0 else 0.0,
        cached=recorder.leaf_ops > 0,
        cached_s=recorder.other_s + recorder.outside_s + max(0.0, plain_s - recorder.ops_s),
        cached_calls=recorder.leaf_ops,
        cached_vids=frozenset(mapped[c] for c in kept if c in mapped),
        cached_kept=tuple((mapped.get(c), n) for c, n in kept.items()),
    )


class _Leaves:
    """While a unit runs again: marks the calls of its product leaves for the recorder.

    A cache answers the product ops run inside those calls only (NOTE [cached products]); the
    unit's other product ops run again.
    """

    def __init__(self, unit: nn.Module, recorder: _OpRecorder) -> None:
        self.recorder = recorder
        self.leaves = product_leaves(unit)
        self._handles: list[Any] = []

    def __enter__(self) -> None:
        for leaf in self.leaves:
            self._handles.append(leaf.register_forward_pre_hook(self._pre))
            self._handles.append(leaf.register_forward_hook(self._post))

    def __exit__(self, *_: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _pre(self, _module: nn.Module, _args: Any) -> None:
        self.recorder.leaf_depth += 1

    def _post(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        self.recorder.leaf_depth -= 1


def selective_cost(other_s: float, ops_s: float, plain_s: float, wall_s: float) -> float:
    """What recomputing a unit selectively costs a step (NOTE [dispatch cost]).

    ``other_s``: its non-product ops' time; ``ops_s``: all its ops' time; ``plain_s``: its
    forward without autograd or a dispatch mode; ``wall_s``: its forward under one, with
    autograd.

    NOTE [dispatch cost]
    Under torch's selective checkpointing every op of the unit, products too, goes through a
    Python dispatch mode twice: in its forward (deciding what to cache) and in its
    recomputation (answering from the cache or running the op), and the recomputation runs the
    unit's Python again. Its non-product ops' time alone was 0.1-0.8 ms for the main job's
    CNN's blocks, whose selective recomputation cost 1-6 ms a step (benchmarks/README.md,
    ``recompute_cost``). So the cost is the non-product ops, the unit's Python outside its ops
    (``plain_s - ops_s``) once, and the mode's overhead (``wall_s - plain_s``: the profile's
    own mode stands in for torch's) twice. Without it the planner took selective recomputation
    for the cheapest way to free bytes where recomputing whole freed them for less. A unit
    behind one node with its product ops' outputs kept (NOTE [cached products]) pays no
    dispatch mode around the whole unit: its cost is the non-product ops and the Python once
    more (``cached_s``), and the mechanism's, a mode inside its product leaves' calls among it.
    """
    return other_s + max(0.0, plain_s - ops_s) + 2 * max(0.0, wall_s - plain_s)


def with_selective(
    unit: TraceUnit,
    profile: SelectiveProfile,
    position: dict[int, int],
    costs: MechanismCosts,
    sizes: Sequence[int],
) -> TraceUnit:
    """``unit`` with what recomputing it selectively frees and keeps (trace vids).

    ``sizes``: the trace's tensors' bytes, by trace vid. Behind one node with its product
    leaves' outputs kept where it can be (NOTE [cached products]), unless SAC, keeping every
    product op's output, costs clearly less per byte it frees (NOTE [ways within noise]); either
    way with the mechanism's own cost (NOTE [mechanism cost]).

    NOTE [ways within noise]
    Both ways' prices are timed runs of a unit's ops, a few milliseconds each, whose noise is
    about a tenth per unit. On a small CNN block, where both keep the same convolution outputs
    and the node only saves SAC's dispatch mode, a plain comparison sent the block through SAC
    in one profile of about twenty, and a class's plans could follow it from profile to
    profile. The one-node way runs no dispatch mode around the unit, and its predictions read
    over its measured cost (1.4-2.2x on the char GPT's blocks: benchmarks/README.md,
    ``recompute_cost``), so SAC is taken only where it frees a byte for less than
    ``1 / _NODE_MARGIN`` of the node's price; a block whose products SAC keeps and the node runs
    again (a transformer's attention) still goes to SAC where SAC is that much cheaper.
    """
    sac = _Way(profile.selective_s + costs.checkpoint_s, profile.product_vids, profile.products)
    way, cached = sac, False
    if profile.cached and unit.one_node:
        mechanism_s = costs.one_node_s + profile.cached_calls * costs.cached_call_s
        node = _Way(profile.cached_s + mechanism_s, profile.cached_vids, profile.cached_kept)
        if node.per_byte(unit, position, sizes) <= _NODE_MARGIN * sac.per_byte(
            unit, position, sizes
        ):
            way, cached = node, True
    products = way.products_in(position)
    return dataclasses.replace(
        unit,
        selective_safe=not profile.why_not,
        why_not_selective=profile.why_not,
        selective_s=way.seconds,
        cached_products=cached,
        selective_vids=tuple(v for v in unit.inner_vids if v not in products),
        product_vids=tuple(v for v in unit.inner_vids if v in products),
        product_bytes=way.unsaved(position),
        tail_s=profile.tail_share * unit.forward_s,
    )


# How much more a byte may cost behind one node than through SAC (NOTE [ways within noise]).
_NODE_MARGIN = 1.25


@dataclass(frozen=True)
class _Way:
    """One way of recomputing a unit selectively: its cost and the product outputs it keeps."""

    seconds: float
    kept_vids: frozenset[int]  # store vids
    kept: tuple[tuple[int | None, int], ...]  # (store vid or None, bytes) per product output

    def products_in(self, position: dict[int, int]) -> set[int]:
        """The kept product outputs that are vTensors of the trace (trace vids)."""
        return {position[v] for v in self.kept_vids if v in position}

    def unsaved(self, position: dict[int, int]) -> int:
        """Bytes of the kept product outputs that are no vTensor of the trace."""
        # Product outputs that are vTensors are counted by vid: inner ones leave the manager,
        # the others (used outside the unit) stay its to move.
        return sum(n for v, n in self.kept if v is None or v not in position)

    def per_byte(self, unit: TraceUnit, position: dict[int, int], sizes: Sequence[int]) -> float:
        """Seconds per byte it frees (inf where it frees none)."""
        products = self.products_in(position)
        freed = sum(sizes[v] for v in unit.inner_vids if v not in products)
        freed -= self.unsaved(position)
        return self.seconds / freed if freed > 0 else float("inf")


def _never(_packed: None) -> torch.Tensor:
    raise AssertionError("the profile's graph is never run backward")
