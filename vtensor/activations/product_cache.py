"""Selective recomputation behind one node: the convolutions' outputs kept from the first run.

NOTE [cached products]
Recomputed selectively under torch's selective checkpointing (NOTE [selective recompute] in
``activations/selective.py``), a unit keeps its product ops' outputs and recomputes the rest,
but every op of it, products too, goes through a Python dispatch mode twice: on the main job's
CNN that made selective recomputation cost what recomputing whole does (NOTE [dispatch cost]
in ``activations/selective_profile.py``). Where one node can stand for the unit (NOTE
[one-node recomputation] in ``activations/rebuild.py``) and every product op it runs is the
convolution of one of its ``nn.Conv1d``/``2d``/``3d`` modules, the node does the same without a
dispatch mode, at module level:

- the first forward (without autograd) keeps each such module's output, in call order;
- the second (in backward, with autograd) answers each call of those modules with the output it
  kept, through ``FromCache``, a node whose backward is the one autograd gives a convolution
  (``aten.convolution_backward`` on the same input, weight and settings: the same gradients,
  bit for bit); everything else runs again.

The outputs are held from the first forward to the unit's backward, as SAC's cache holds them,
and the planner counts them so (``with_recompute`` in ``planner/recomputed.py``). A module
answered this way is a plain convolution: of exactly those types, zero padding given as
numbers, its ``forward`` not replaced, called with a batched input and autocast off (autocast
casts the input and the weight inside the call, which the kept output's backward would not
see). The profile checks that each of its calls runs one product op and that the unit runs no
other (``TraceUnit.cached_products``). A call that finds no kept output for it (a second
backward through the same graph; a call out of the first run's order; autocast turned on
since) computes the convolution again: slower, never different.
"""

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def cacheable(module: nn.Module) -> bool:
    """Whether ``FromCache`` can answer ``module``'s calls (NOTE [cached products])."""
    return (
        type(module) in CONVOLUTIONS
        and "forward" not in module.__dict__
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
    )


def product_leaves(unit: nn.Module) -> list[nn.Module]:
    """The modules of ``unit`` (itself included) whose outputs a cache may hold."""
    return [m for m in unit.modules() if cacheable(m)]


def answerable(module: nn.Module, x: object) -> bool:
    """Whether a kept output can answer the call of the convolution ``module`` on ``x``.

    ``x`` is a batched input and autocast is off on its device: autocast casts the input and
    the weight inside ``F.conv2d``, and the kept output's backward would take the uncast ones.
    """
    stride = cast(tuple[int, ...], module.stride)
    return (
        isinstance(x, torch.Tensor)
        and x.dim() == len(stride) + 2
        and not torch.is_autocast_enabled(x.device.type)
    )


class ProductCache:
    """The outputs of a unit's convolutions from its first run, handed to its second."""

    def __init__(self, unit: nn.Module) -> None:
        self.leaves = product_leaves(unit)
        self.kept: list[tuple[nn.Module, torch.Size, torch.Tensor | None]] = []
        self._next = 0

    @contextlib.contextmanager
    def keeping(self) -> Iterator[None]:
        """The first run: each convolution's output is kept."""
        self.kept.clear()
        with self._patched(self._keep):
            yield

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        """The second run: each convolution answered with the output kept for its call."""
        self._next = 0
        with self._patched(self._answer):
            yield

    def clear(self) -> None:
        """Let go of what is still kept."""
        self.kept.clear()

    @contextlib.contextmanager
    def _patched(self, call: Any) -> Iterator[None]:
        # Into the instance's dict, as ``recompute_modules`` does: hooks cannot skip a forward.
        patched = []
        try:
            for leaf in self.leaves:
                leaf.__dict__["forward"] = _bound(call, leaf)
                patched.append(leaf)
            yield
        finally:
            for leaf in patched:
                leaf.__dict__.pop("forward", None)

    def _keep(self, leaf: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = type(leaf).forward(leaf, x)
        if answerable(leaf, x):
            self.kept.append((leaf, x.shape, out))
        return out

    def _answer(self, leaf: nn.Module, x: torch.Tensor) -> torch.Tensor:
        k, self._next = self._next, self._next + 1
        if k < len(self.kept):
            kept_leaf, shape, out = self.kept[k]
            if kept_leaf is leaf and out is not None and x.shape == shape and answerable(leaf, x):
                self.kept[k] = (kept_leaf, shape, None)  # the graph holds it from here
                bias = leaf.bias
                settings = (leaf.stride, leaf.padding, leaf.dilation, leaf.groups)
                return FromCache.apply(x, leaf.weight, bias, _Kept(out, settings))  # type: ignore[no-any-return,no-untyped-call]
        self.kept.clear()  # out of order: nothing kept is the answer to a later call either
        return type(leaf).forward(leaf, x)  # type: ignore[no-any-return]


def _bound(call: Any, leaf: nn.Module) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return call(leaf, x)  # type: ignore[no-any-return]

    return forward


class _Kept:
    """A kept output and its convolution's settings, handed to ``FromCache`` once."""

    __slots__ = ("out", "settings")

    def __init__(self, out: torch.Tensor, settings: tuple[Any, ...]) -> None:
        self.out: torch.Tensor | None = out
        self.settings = settings


class FromCache(torch.autograd.Function):
    """A convolution answered from the cache; its backward is the convolution's own."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kept: _Kept
    ) -> torch.Tensor:
        """The kept output, with the inputs its backward needs saved."""
        ctx.save_for_backward(x, weight)
        ctx.settings = kept.settings
        ctx.bias_sizes = None if bias is None else list(bias.shape)
        out, kept.out = kept.out, None
        assert out is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """What autograd's node for ``aten.convolution`` computes, by the same call."""
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.settings
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]]
        gx, gw, gb = torch.ops.aten.convolution_backward(
            grad,
            x,
            weight,
            ctx.bias_sizes,
            list(stride),
            list(padding),
            list(dilation),
            False,
            [0] * len(stride),
            groups,
            mask,
        )
        return gx, gw, gb, None
