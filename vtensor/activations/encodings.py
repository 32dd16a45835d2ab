"""Lossless encodings of saved tensors: a clamp's backward needs one bit per element.

NOTE [mask encoding]
``nn.Hardtanh`` and ``nn.ReLU6`` (not in place) save their whole input for backward, and
backward uses it for one thing only: whether each element lay strictly inside the clamp's
bounds (``aten.hardtanh_backward`` passes the gradient there and writes 0 elsewhere). In a
network of convolution, normalization and ReLU6 the normalization's output is saved by the
ReLU6 alone, so autograd holds a whole float tensor where one bit per element would do (Gist,
ISCA'18, binarizes ReLU-pool pairs the same way). For the step, a managed iteration runs such
modules through ``MaskedHardtanh``: the same forward kernel, and a saved tensor of packed bits
(1/32 of a float32 input) in place of the input. Backward passes each element's gradient
where its bit is 1 and writes +0 where it is 0, by ANDing the gradient's bits with all ones or
all zeros, as the kernel's own vectorized loop does with its comparisons (its scalar loop gives
the same for any input that is not NaN): every gradient is bit-identical to the unencoded
module's. Where the gradient is not contiguous, or a graph of the backward is built (double
backward), it rebuilds a stand-in input from the bits instead (the lower bound outside, a value
strictly inside the bounds inside) and calls the same backward kernel with it. An input with a
NaN is saved as it is: torch's kernel passes or zeroes a NaN's gradient depending on where it
falls in its vectorized loop. The bits are saved through the manager's hooks like any saved
tensor: the plan keeps, swaps or recomputes them.

Encoded only where this is exact and cheap: CPU, float32 or float64, contiguous inputs of a
module of exactly those types whose forward is not patched, with bounds for which an inside
value exists in the dtype. Anything else runs the module's own forward. The bits are packed
with numpy (torch's boolean ops run several times slower here; ``benchmarks.mask_encoding``),
a block at a time: a pass over the whole tensor allocated temporaries of its size (a stand-in
input as large as the input itself in backward), and where the allocator maps each large block
afresh (the honest-RSS setting of the benchmarks) their page faults cost more than the passes.
What is given up: an in-place change to the input after the forward, which autograd would
report at backward, goes unseen; the gradient is still that of the forward that ran. A
functional ``F.relu6`` call inside another module's forward is not encoded.
"""

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

MASKABLE: tuple[type[nn.Module], ...] = (nn.Hardtanh, nn.ReLU6)
_DTYPES: dict[torch.dtype, type[np.floating[Any]]] = {
    torch.float32: np.float32,
    torch.float64: np.float64,
}
_WORDS: dict[torch.dtype, type[np.unsignedinteger[Any]]] = {
    torch.float32: np.uint32,
    torch.float64: np.uint64,
}
BLOCK = 1 << 18  # elements per pass (a multiple of 8: each block fills whole bytes)


@functools.lru_cache(maxsize=64)  # asked at every clamp's forward
def inside_step(low: float, high: float, dtype: torch.dtype) -> float | None:
    """The stand-in's step above ``low`` for an inside element, or None if there is none.

    In ``dtype`` (bounds cast to it, as torch's kernel compares them), ``0 * step + low`` is
    ``low`` and ``1 * step + low`` lies strictly between ``low`` and ``high``.
    """
    kind = _DTYPES.get(dtype)
    if kind is None:
        return None
    lo, hi = kind(low), kind(high)
    if not (np.isfinite(lo) and np.isfinite(hi) and lo < hi):
        return None
    step = kind(kind((float(lo) + float(hi)) / 2) - lo)
    if not (step > 0 and lo < kind(step + lo) < hi):
        return None
    return float(step)


def encode(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """One bit per element of ``x``: 1 where it lay strictly inside the bounds (no NaN in it)."""
    values = x.detach().numpy().reshape(-1)
    kind = values.dtype.type
    lo, hi = kind(low), kind(high)
    bits = torch.empty((values.size + 7) // 8, dtype=torch.uint8)  # torch's, as the store expects
    packed = bits.numpy()
    inside, below = np.empty((2, min(BLOCK, values.size)), dtype=bool)
    for start in range(0, values.size, BLOCK):
        block = values[start : start + BLOCK]
        a, b = inside[: block.size], below[: block.size]
        np.greater(block, lo, out=a)
        np.less(block, hi, out=b)
        np.logical_and(a, b, out=a)
        packed[start // 8 : (start + block.size + 7) // 8] = np.packbits(a)
    return bits


@functools.lru_cache(maxsize=64)
def _stand_ins(dtype: torch.dtype, low: float, step: float) -> Any:
    """Each byte's eight stand-in values (``low``, or ``low + step`` where its bit is 1)."""
    kind = _DTYPES[dtype]
    flags = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(kind)
    flags *= kind(step)
    flags += kind(low)
    return flags


def decode(
    bits: torch.Tensor, shape: torch.Size, dtype: torch.dtype, low: float, step: float
) -> torch.Tensor:
    """A stand-in input: ``low`` where the bit is 0, ``low + step`` where it is 1 (contiguous).

    One gather from a table of each byte's eight values (unpacking the bits and scaling them
    took twice as long; ``benchmarks.mask_encoding``).
    """
    values = np.take(_stand_ins(dtype, low, step), bits.numpy(), axis=0)
    return torch.from_numpy(values.reshape(-1)[: shape.numel()]).view(shape)


@functools.lru_cache(maxsize=4)
def _word_masks(dtype: torch.dtype) -> Any:
    """Each byte's eight element masks: all ones where its bit is 1, zeros elsewhere."""
    kind = _WORDS[dtype]
    flags = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(bool)
    return np.where(flags, kind(np.iinfo(kind).max), kind(0))


def masked_gradient(bits: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` where the bit is 1, +0 elsewhere (``grad`` contiguous, float32 or float64).

    The backward kernel's result for an input the bits describe, bit for bit: its vectorized
    loop ANDs the gradient with its comparisons' masks, as here.
    """
    kind = _WORDS[grad.dtype]
    result = torch.empty_like(grad)
    incoming = grad.detach().numpy().reshape(-1).view(kind)
    outgoing = result.numpy().reshape(-1).view(kind)
    table, packed = _word_masks(grad.dtype), bits.numpy()
    masks = np.empty(min(BLOCK, incoming.size), dtype=kind)
    for start in range(0, incoming.size, BLOCK):
        n = min(BLOCK, incoming.size - start)
        whole, first = n // 8, start // 8
        rows = masks[: whole * 8].reshape(whole, 8)
        np.take(table, packed[first : first + whole], axis=0, out=rows, mode="clip")
        if n % 8:  # the last byte's leading bits
            masks[whole * 8 : n] = table[packed[first + whole]][: n % 8]
        np.bitwise_and(masks[:n], incoming[start : start + n], out=outgoing[start : start + n])
    return result


class MaskedHardtanh(torch.autograd.Function):
    """``aten.hardtanh`` that saves packed bits instead of its input (NOTE [mask encoding])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, low: float, high: float, step: float) -> torch.Tensor:
        """The module's forward kernel; the bits saved for backward (the input, if any NaN)."""
        # torch's backward kernel treats a NaN input by its position (its vectorized loop zeroes
        # the gradient, its scalar tail passes it): no bit can say which, so keep the input. The
        # output is bounded, so its sum is NaN exactly when an input was.
        out: torch.Tensor = torch.ops.aten.hardtanh(x, low, high)
        ctx.encoded = not math.isnan(out.sum().item())
        ctx.save_for_backward(encode(x, low, high) if ctx.encoded else x)
        ctx.meta = (x.shape, x.dtype, low, high, step)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        """The module's backward kernel on the stand-in input."""
        (saved,) = ctx.saved_tensors
        shape, dtype, low, high, step = ctx.meta
        if ctx.encoded and grad.is_contiguous() and not torch.is_grad_enabled():
            return masked_gradient(saved, grad), None, None, None
        # A graph of this backward (double backward) needs torch's kernel.
        stand_in = decode(saved, shape, dtype, low, step) if ctx.encoded else saved
        grad_in: torch.Tensor = torch.ops.aten.hardtanh_backward(grad, stand_in, low, high)
        return grad_in, None, None, None


def _masked_forward(module: nn.Hardtanh, own: Any) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        step = None
        if (
            torch.is_grad_enabled()
            and type(x) is torch.Tensor
            and x.requires_grad
            and x.device.type == "cpu"
            and x.is_contiguous()
        ):
            step = inside_step(module.min_val, module.max_val, x.dtype)
        if step is None:
            plain: torch.Tensor = own(x)
            return plain
        out: torch.Tensor = MaskedHardtanh.apply(  # type: ignore[no-untyped-call]
            x, module.min_val, module.max_val, step
        )
        return out

    return forward


@contextlib.contextmanager
def masks_encoded(modules: Sequence[nn.Module]) -> Iterator[int]:
    """For one step, run each of ``modules`` that may be encoded through ``MaskedHardtanh``.

    ``modules`` are a scan's candidates (``ModelScan.maskable``); one whose type is not
    exactly a maskable one, that clamps in place, or whose forward is already patched (a
    recomputed module) keeps its own. Yields how many were wrapped.
    """
    wrapped: list[nn.Module] = []
    try:
        for module in modules:
            if (
                type(module) in MASKABLE
                and isinstance(module, nn.Hardtanh)
                and not module.inplace
                and "forward" not in module.__dict__
            ):
                module.forward = _masked_forward(module, module.forward)  # type: ignore[method-assign]
                wrapped.append(module)
        yield len(wrapped)
    finally:
        for module in wrapped:
            del module.forward


def side_effect_free(node: Any) -> bool:
    """Whether a custom Function's backward node is one of these encodings (safe to recompute)."""
    return getattr(node, "_forward_cls", None) is MaskedHardtanh
