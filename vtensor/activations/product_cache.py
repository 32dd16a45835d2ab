"""Selective recomputation behind one node: the product ops' outputs kept from the first run.

NOTE [cached products]
Recomputed selectively under torch's selective checkpointing (NOTE [selective recompute] in
``activations/selective.py``), a unit keeps its product ops' outputs and recomputes the rest,
but every op of it, products too, goes through a Python dispatch mode twice: on the main job's
CNN that made selective recomputation cost what recomputing whole does (NOTE [dispatch cost]
in ``activations/selective_profile.py``). Where one node can stand for the unit (NOTE
[one-node recomputation] in ``activations/rebuild.py``) and it runs product ops inside calls of
its ``nn.Conv1d``/``2d``/``3d`` or ``nn.Linear`` modules (its product leaves), the node does
much the same with a dispatch mode inside those calls only:

- the first forward (without autograd) keeps the output of each product op those calls run,
  in order, with the op and its tensor arguments' shapes;
- the second (in backward, with autograd) runs everything again, those calls too, but in
  them a product op that matches the next kept one (the same op on arguments of the same
  shapes) is answered with the kept output instead of being computed. Autograd records the
  op as it records it without recomputation (the mode sits below autograd), so the backward is
  autograd's own for that op, on the same inputs: the same gradients, bit for bit, whatever
  the op's backward does with its operands' strides (a matrix product's) or whether autocast
  cast them inside the call.

Product ops outside those calls (``F.conv2d``, a transformer's attention scores and weighted
values) run again with the rest, as SAC would not: their outputs are freed too, at the cost of
computing them again (an attention's T x T raw scores, which SAC keeps). The profile prices
both ways and takes this one unless SAC frees a byte for less (``with_selective`` in
``activations/selective_profile.py``). The kept outputs are held
from the first forward to the unit's backward, as SAC's cache holds them, and the planner counts
them so (``with_recompute`` in ``planner/recomputed.py``); the profile finds which product ops
ran inside the leaves' calls, what they kept and what the others cost
(``TraceUnit.cached_products``). A leaf is of exactly those types, its ``forward`` not replaced.
A product op that finds no matching kept output (a second backward through the same graph; a
call out of the first run's order) is computed, and nothing kept is used from then on: slower,
never different.
"""

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from vtensor.activations.selective import is_product

PRODUCT_LEAVES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)

_Shapes = tuple[torch.Size, ...]


def cacheable(module: nn.Module) -> bool:
    """Whether a cache may answer the product ops of ``module``'s calls (NOTE [cached products])."""
    return type(module) in PRODUCT_LEAVES and "forward" not in module.__dict__


def product_leaves(unit: nn.Module) -> list[nn.Module]:
    """The modules of ``unit`` (itself included) whose product ops a cache may answer."""
    return [m for m in unit.modules() if cacheable(m)]


def shapes_of(args: Sequence[Any]) -> _Shapes:
    """The shapes of an op's tensor arguments, in order: what a kept output must match."""
    return tuple(a.shape for a in args if isinstance(a, torch.Tensor))


class ProductCache:
    """The outputs of a unit's product ops from its first run, handed to its second."""

    def __init__(self, unit: nn.Module) -> None:
        self.leaves = product_leaves(unit)
        self.kept: list[tuple[Any, _Shapes, torch.Tensor | None]] = []
        self._next = 0
        self._keeping = _Keeping(self.kept)
        self._answering = _Answering(self)

    @contextlib.contextmanager
    def keeping(self) -> Iterator[None]:
        """The first run: each product op's output in the leaves' calls is kept."""
        self.kept.clear()
        with self._patched(self._keeping):
            yield

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        """The second run: each product op in the leaves' calls answered from what is kept."""
        self._next = 0
        with self._patched(self._answering):
            yield

    def clear(self) -> None:
        """Let go of what is still kept."""
        self.kept.clear()

    def answer(self, op: Any, args: Sequence[Any]) -> torch.Tensor | None:
        """The kept output for this call of ``op`` (``None``: compute it)."""
        k, self._next = self._next, self._next + 1
        if k < len(self.kept):
            kept_op, shapes, out = self.kept[k]
            if kept_op is op and out is not None and shapes == shapes_of(args):
                self.kept[k] = (kept_op, shapes, None)  # the graph holds it from here
                return out.detach()  # a tensor of its own for autograd to record
        self.kept.clear()  # out of order: nothing kept answers a later op either
        return None

    @contextlib.contextmanager
    def _patched(self, mode: TorchDispatchMode) -> Iterator[None]:
        # Into the instance's dict, as ``recompute_modules`` does: the mode is in force inside
        # the leaves' own forward only, so the unit's other ops run without Python dispatch.
        patched = []
        try:
            for leaf in self.leaves:
                leaf.__dict__["forward"] = _inside(mode, leaf)
                patched.append(leaf)
            yield
        finally:
            for leaf in patched:
                leaf.__dict__.pop("forward", None)


def _inside(mode: TorchDispatchMode, leaf: nn.Module) -> Any:
    forward = type(leaf).forward

    def run(*args: Any, **kwargs: Any) -> Any:
        with mode:
            return forward(leaf, *args, **kwargs)

    return run


class _Keeping(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs each op; keeps each product op's output with the op and its arguments' shapes."""

    def __init__(self, kept: list[tuple[Any, _Shapes, torch.Tensor | None]]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.kept = kept

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if is_product(func) and isinstance(out, torch.Tensor):
            self.kept.append((func, shapes_of(args), out))
        return out


class _Answering(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Answers each product op from the cache where it can; runs every other op."""

    def __init__(self, cache: ProductCache) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cache = cache

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if is_product(func):
            out = self.cache.answer(func, args)
            if out is not None:
                return out
        return func(*args, **(kwargs or {}))
