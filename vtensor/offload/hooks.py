"""Torch glue of parameter offloading: module, autograd-node and gradient hooks. They only route."""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

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
    handles.append(
        model.register_forward_pre_hook(lambda _m, _a: target.begin_forward(), prepend=True)
    )
    handles.append(
        model.register_forward_hook(lambda _m, _a, _o: target.end_forward(), always_call=True)
    )
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
