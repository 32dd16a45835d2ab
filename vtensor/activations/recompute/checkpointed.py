"""Recomputation at run time: chosen modules run their forward again in backward.

NOTE [recompute]
A recomputed module saves only its inputs; backward runs its forward again right before it needs
what it saved, through torch's non-reentrant checkpointing with the RNG state preserved, for the
managed step only. Done here beyond checkpointing: the manager's module hooks ignore the
recomputed forward, and the module's buffers are put back afterwards (BatchNorm would update its
statistics twice). The plan chooses among the modules the profile found safe.
"""

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from vtensor.errors import VTensorError


class RecomputeTarget(Protocol):
    """What is told that a forward is being run again (the iteration)."""

    recomputing: int
    device: torch.device  # whose work a profile's clock waits for (``device_now``)


class RecomputeHost(RecomputeTarget, Protocol):
    """The iteration a plan's recomputations run in: it measures what each one grows."""

    def recompute_began(self, regrowth_bytes: int) -> None:
        """A recomputation starts; ``regrowth_bytes``: what it brings back (0: unknown/planned)."""
        ...

    def recompute_ended(self) -> None:
        """The recomputation ``recompute_began`` announced is done (NOTE [recomputed growth])."""
        ...


@contextlib.contextmanager
def recomputing(
    target: RecomputeHost, module: nn.Module, regrowth_bytes: int = 0, *, buffers: bool = True
) -> Iterator[None]:
    """Run ``module``'s forward again: hooks ignore it; buffers put back unless not ``buffers``."""
    values = buffers_of(module) if buffers else []
    target.recomputing += 1
    target.recompute_began(regrowth_bytes)
    try:
        yield
    finally:
        target.recompute_ended()
        target.recomputing -= 1
        put_back(values)


def buffers_of(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each buffer of ``module`` with a copy of its value now."""
    return [(b, b.detach().clone()) for b in module.buffers()]


def put_back(values: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write back the values ``buffers_of`` copied."""
    with torch.no_grad():
        for buffer, value in values:
            buffer.copy_(value)


@contextlib.contextmanager
def recompute_modules(
    model: nn.Module,
    names: Sequence[str],
    target: RecomputeHost,
    regrowth: Mapping[str, int] | None = None,
) -> Iterator[None]:
    """Wrap the forward of each named module of ``model`` in checkpointing, for one step.

    ``regrowth``: the bytes each recomputation brings back at once (NOTE [recomputed growth]).
    """
    # By path, not by walking every module: this runs at every replay.
    modules: dict[str, nn.Module] = {}
    missing: list[str] = []
    for name in names:
        try:
            modules[name] = model.get_submodule(name)
        except AttributeError:
            missing.append(name)
    if missing:
        raise VTensorError(
            f"the plan recomputes modules {missing} that the model does not have; the plan is "
            "of another model: clear the plan cache or profile again"
        )
    wrapped: list[nn.Module] = []
    try:
        for name in names:
            module = modules[name]
            if "forward" in module.__dict__:
                raise VTensorError(
                    f"module {name!r} has its own forward attribute (patched or already "
                    "wrapped): it cannot be recomputed"
                )
            expected = (regrowth or {}).get(name, 0)
            # Into the instance's dict: ``Module.__setattr__`` searches parameters and buffers.
            module.__dict__["forward"] = _checkpointed(module, module.forward, target, expected)
            wrapped.append(module)
        yield
    finally:
        for module in wrapped:
            module.__dict__.pop("forward", None)


def _checkpointed(
    module: nn.Module,
    forward: Callable[..., Any],
    target: RecomputeHost,
    regrowth_bytes: int,
) -> Callable[..., Any]:
    """``forward`` recomputed through torch's checkpointing."""

    def contexts() -> tuple[contextlib.AbstractContextManager[Any], Any]:
        return contextlib.nullcontext(), recomputing(target, module, regrowth_bytes)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)  # nothing is saved: nothing to recompute
        call = CallSnapshot(args, kwargs)
        # No closure holds a tensor: the inputs live under the saved-tensor hooks (swappable).
        tensors = call.hand_over()
        pending = [(args, kwargs)]

        def again(*inputs: torch.Tensor) -> Any:
            if pending:  # the forward itself: the caller's own arguments, as without recompute
                own_args, own_kwargs = pending.pop()
                return forward(*own_args, **own_kwargs)
            rebuilt_args, rebuilt_kwargs = call.rebuild(inputs)
            return forward(*rebuilt_args, **rebuilt_kwargs)

        return checkpoint(
            again,
            *tensors,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=contexts,
        )

    return run


class CallSnapshot:
    """A forward's arguments as they were at the call, to run it again from (NOTE [call snapshot]).

    NOTE [call snapshot]
    Checkpointing hands a forward's tensors back one by one: a tensor passed twice comes back as
    two objects, and a container changed after the call is seen as it is then; both change the
    result silently (``nn.MultiheadAttention`` when ``query is key``). So the arguments are
    flattened at the call, each distinct tensor handed over once, and rebuilt as they were.
    """

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        leaves, self._spec = tree_flatten((args, kwargs))
        self.tensors: list[torch.Tensor] = []
        index: dict[int, int] = {}
        self._slots: list[int | None] = []  # per leaf: its tensor's place in ``tensors``
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                slot = index.setdefault(id(leaf), len(self.tensors))
                if slot == len(self.tensors):
                    self.tensors.append(leaf)
                self._slots.append(slot)
            else:
                self._slots.append(None)
        self._others = [None if isinstance(v, torch.Tensor) else v for v in leaves]

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments in new containers, ``tensors`` in place of the call's, in their order."""
        leaves = [
            other if slot is None else tensors[slot]
            for slot, other in zip(self._slots, self._others, strict=True)
        ]
        args, kwargs = tree_unflatten(leaves, self._spec)
        return args, kwargs

    def copy(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments in new containers holding the call's own objects."""
        return self.rebuild(self.tensors)

    def hand_over(self) -> list[torch.Tensor]:
        """The call's distinct tensors, which the snapshot then no longer holds."""
        tensors, self.tensors = self.tensors, []
        return tensors
