"""Torch glue of parameter offloading: hooks that only route, and the first forward's guard."""

from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from vtensor.errors import ParamOffloadError
from vtensor.offload.records import ParamRecord
from vtensor.offload.units import Unit
from vtensor.outputs import tensors_in

if TYPE_CHECKING:
    from vtensor.offload.passes import OffloadPasses


def install_offload_hooks(model: nn.Module, target: "OffloadPasses") -> list[RemovableHandle]:
    """Route forward boundaries of ``model`` and its units, and gradient arrivals, to ``target``.

    Post-hooks are ``always_call``, so a forward that raises still ends its calls; the root's
    hooks wrap any unit hooks of the root.
    """
    handles: list[RemovableHandle] = []
    for unit in target.units:

        def pre(_module: nn.Module, _args: Any, unit: Unit = unit) -> None:
            target.begin_call(unit)

        def post(_module: nn.Module, _args: Any, output: Any, unit: Unit = unit) -> None:
            target.end_call(unit, output)

        handles.append(unit.module.register_forward_pre_hook(pre))
        handles.append(unit.module.register_forward_hook(post, always_call=True))
    handles += [
        model.register_forward_pre_hook(lambda _m, _a: target.begin_forward(), prepend=True),
        model.register_forward_hook(lambda _m, _a, _o: target.end_forward(), always_call=True),
    ]
    for record in target.params.values():
        if record.param.requires_grad:

            def arrived(_param: torch.Tensor, record: ParamRecord = record) -> None:
                target.take_gradient(record)

            handles.append(
                record.param.register_post_accumulate_grad_hook(arrived)  # type: ignore[no-untyped-call]
            )
    return handles


def on_backward_start(output: Any, callback: Callable[[], None]) -> None:
    """Call ``callback`` before autograd runs any node of the module that made ``output``.

    Also on their bases' nodes: a view's node leaves the graph if the view is later changed in
    place (``ReLU(inplace=True)`` after a 3-D ``Linear``); its base's stays.
    """

    def hook(_grads: Any) -> None:
        callback()

    nodes = {}
    for tensor in tensors_in(output):
        base: torch.Tensor | None = tensor
        while base is not None:
            if base.grad_fn is not None:
                nodes[id(base.grad_fn)] = base.grad_fn
            base = base._base
    for node in nodes.values():
        node.register_prehook(hook)


class UseGuard(TorchFunctionMode):
    """First forward only: every managed parameter an op receives belongs to a running unit.

    Between uses an offloaded parameter's storage holds no bytes, so an op using it outside the
    forward of a module that owns it (``F.linear(h, self.embed.weight)`` in a parent) would read
    freed memory: an error that names the fix, never a crash.
    """

    def __init__(
        self, records: Iterable[ParamRecord], units: list[Unit], running: Counter[str]
    ) -> None:
        super().__init__()
        # storage -> (parameter name, names of the units that own it)
        self.owners = {
            r.entry.storage._cdata: (r.name, frozenset(units[i].name for i in r.units))
            for r in records
            if not r.fixed
        }
        self.running = running  # units whose forward is running now (a unit may nest in itself)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for leaf in tree_leaves((args, kwargs)):
            if not isinstance(leaf, torch.Tensor):
                continue
            owner = self.owners.get(leaf.untyped_storage()._cdata)
            if owner is not None and not any(self.running[u] for u in owner[1]):
                users = sorted(u or "<root>" for u, n in self.running.items() if n) or ["<root>"]
                owned_by = sorted(u or "<root>" for u in owner[1])
                raise ParamOffloadError(
                    f"parameter {owner[0]!r} is used by {getattr(func, '__name__', func)} "
                    f"outside the forward of the module(s) that own it ({owned_by}); running: "
                    f"{users}. Offloading brings a parameter in only for its own modules: pass "
                    f"resident=[{owned_by[0]!r}] to keep it in memory, or tie it as a shared "
                    "Parameter of the module that uses it (head.weight = embed.weight)"
                )
        return func(*args, **(kwargs or {}))
