"""Clamps that save their output, not their input: what their backward needs, for free.

NOTE [mask encoding]
``nn.Hardtanh`` and ``nn.ReLU6`` save their input, yet backward needs only whether each element
lay strictly inside the bounds, which the output tells too: ``aten.hardtanh_backward`` given the
output returns every gradient bit for bit. The next layer usually saves that output anyway, so
saving it instead (``MaskedHardtanh``, as ``nn.ReLU`` does) stores one tensor where there were
two. Encoded only where exact: a floating-point input that requires grad, a module of exactly
those types, out of place, with an unpatched forward. An in-place change to the output before
the clamp's backward raises; functional ``F.relu6`` calls are not encoded.
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
        # Saved-tensor hooks turn autograd's in-place check off: check the version here too.
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
        # Detached: double backward flows through ``grad`` only, as through torch's kernel.
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

    ``names``: by ``id``, for errors. Yields how many were wrapped.
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
                # Into the instance's dict, as in ``recompute_modules``.
                module.__dict__["forward"] = _masked_forward(module, module.forward, name)
                wrapped.append(module)
        yield len(wrapped)
    finally:
        for module in wrapped:
            module.__dict__.pop("forward", None)


def side_effect_free(node: Any) -> bool:
    """Whether a custom Function's backward node is one of these encodings (safe to recompute)."""
    return getattr(node, "_forward_cls", None) is MaskedHardtanh
