"""Clamps that save their output, not their input: what their backward needs, for free.

NOTE [mask encoding]
``nn.Hardtanh`` and ``nn.ReLU6`` (not in place) save their whole input for backward, and
backward uses it for one thing only: whether each element lay strictly inside the clamp's
bounds (``aten.hardtanh_backward`` passes the gradient there and writes 0 elsewhere). In a
network of convolution, normalization and ReLU6 the normalization's output is saved by the
ReLU6 alone, while the ReLU6's output is saved by the convolution that follows. For the step, a
managed iteration runs such modules through ``MaskedHardtanh``: the same forward kernel, and
the output saved in place of the input, as ``nn.ReLU`` does. The output tells the same thing:
an element inside the bounds passes through unchanged, one at or beyond a bound becomes that
bound (not strictly inside), and a NaN stays a NaN in the same position, so the same backward
kernel given the output returns every gradient bit for bit (tested at and around the bounds,
with signed zeros, infinities and NaN, in float32 and float64). Where the next layer saves the
output anyway, the clamp's input is no longer held by anyone: one tensor saved where there were
two, at no cost beyond the ``autograd.Function``'s call (Gist, ISCA'18, binarizes ReLU-pool
pairs for the same reason; packed bits had cost the main job's CNN 0.14-0.17 of its step in
numpy passes, benchmarks/README.md, ``mask_encoding``). Where nothing else keeps the output,
the clamp holds it instead of its input: the same bytes as without the encoding. The output is
saved through the manager's hooks like any saved tensor (the same storage as the next layer's
save): the plan keeps, swaps or recomputes it.

Encoded only where this is exact: a floating-point input that requires grad, given to a module
of exactly those types, out of place, whose forward is not patched. Anything else runs the
module's own forward. What is given up: an in-place change to the output after the forward and
before the clamp's backward, which plain PyTorch would allow where nothing else saved the
output, stops the backward, as it would for ``nn.ReLU``; the error names the module and says
to train with ``encode_masks=False``. An in-place change to the input after the forward, which
autograd would report, goes unseen: the gradient is that of the forward that ran. A functional
``F.relu6`` call inside another module's forward is not encoded.
"""

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from vtensor.errors import VTensorError

MASKABLE: tuple[type[nn.Module], ...] = (nn.Hardtanh, nn.ReLU6)


class MaskedHardtanh(torch.autograd.Function):
    """``aten.hardtanh`` that saves its output instead of its input (NOTE [mask encoding])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, low: float, high: float, name: str) -> torch.Tensor:
        """The module's forward kernel; the output saved for backward."""
        out: torch.Tensor = torch.ops.aten.hardtanh(x, low, high)
        ctx.save_for_backward(out)
        # Saved-tensor hooks switch autograd's own check of in-place changes off (the manager's
        # check instead, but other hooks may not): the version is checked here too.
        ctx.meta = (low, high, name, out._version)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        """The module's backward kernel, given the output where it was given the input."""
        low, high, name, version = ctx.meta
        try:
            (saved,) = ctx.saved_tensors
        except RuntimeError as error:  # autograd's check, or the manager's (InPlaceModification)
            if "modified" not in str(error):
                raise
            raise _changed_in_place(name) from error
        if saved._version != version:
            raise _changed_in_place(name)
        # Detached: the gradient of this backward (double backward) flows through ``grad``
        # only, as through torch's own kernel, whose derivative in its input is zero.
        grad_in: torch.Tensor = torch.ops.aten.hardtanh_backward(grad, saved.detach(), low, high)
        return grad_in, None, None, None


def _changed_in_place(name: str) -> VTensorError:
    return VTensorError(
        f"the output of {name!r} was modified in place after its forward; with encode_masks a "
        "clamp saves its output for backward instead of its input (NOTE [mask encoding] in "
        "vtensor/activations/encode.py): train this model with encode_masks=False"
    )


def masked_hardtanh(x: torch.Tensor, low: float, high: float, name: str) -> torch.Tensor:
    """``hardtanh`` of ``x`` that saves its output for backward (NOTE [mask encoding])."""
    out: torch.Tensor = MaskedHardtanh.apply(x, low, high, name)  # type: ignore[no-untyped-call]
    return out


def _masked_forward(module: nn.Hardtanh, own: Any, name: str) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if not (
            torch.is_grad_enabled()
            and type(x) is torch.Tensor
            and x.requires_grad
            and x.is_floating_point()
        ):
            plain: torch.Tensor = own(x)
            return plain
        return masked_hardtanh(x, module.min_val, module.max_val, name)

    return forward


@contextlib.contextmanager
def masks_encoded(
    modules: Sequence[nn.Module], names: Mapping[int, str] | None = None
) -> Iterator[int]:
    """For one step, run each of ``modules`` that may be encoded through ``MaskedHardtanh``.

    ``modules`` are a scan's candidates (``ModelScan.maskable``), ``names`` their names by
    ``id`` (``ModelScan.names``, for errors); one whose type is not exactly a maskable one,
    that clamps in place, or whose forward is already patched (a recomputed module) keeps its
    own. Yields how many were wrapped.
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
                name = (names or {}).get(id(module), type(module).__name__)
                # Into the instance's dict, as in ``recompute_modules``: at every step.
                module.__dict__["forward"] = _masked_forward(module, module.forward, name)
                wrapped.append(module)
        yield len(wrapped)
    finally:
        for module in wrapped:
            module.__dict__.pop("forward", None)


def side_effect_free(node: Any) -> bool:
    """Whether a custom Function's backward node is one of these encodings (safe to recompute)."""
    return getattr(node, "_forward_cls", None) is MaskedHardtanh
