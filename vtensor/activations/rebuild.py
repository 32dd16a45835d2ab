"""Recomputing a unit whole with one autograd node: its forward without a graph, rebuilt later.

NOTE [one-node recomputation]
torch's non-reentrant checkpointing runs a recomputed unit's forward with autograd on: it builds
the unit's graph and sends every tensor the unit saves through a Python hook that drops it, and
in backward a second hook per tensor hands back what the recomputation made: a unit's forward
costs more than without recomputation. ``Rebuild`` does what torch's reentrant checkpointing
does instead: the forward runs without autograd and one node stands for the whole unit; its
backward runs the forward again with autograd and takes the gradients of that rebuilt graph
(measured against checkpointing: benchmarks/README.md, ``recompute_cost``). torch's reentrant
variant is not used as it is because it accumulates the unit's parameter gradients itself,
inside its backward, which ``torch.autograd.grad`` and ``backward(inputs=...)`` cannot
follow; here the parameters are inputs of the node, so their gradients flow through the outer
graph as without recomputation, and each gradient is the same computation on the same values
(bit for bit).

What the node needs that checkpointing gave: the RNG state of the forward (CPU and the inputs'
device) and its autocast state, restored for the second run; the inputs it saves go through the
manager's saved-tensor hooks like any saved tensor (a plan may swap them). The rebuilt graph's
own saved tensors stay outside the manager, under hooks of the node's own that let each go at
its unpack, as checkpointing does (the planner's NOTE [recomputed lifetimes]), where the
manager's hooks are in force; where none are, autograd keeps them (NOTE [own hooks]).

A unit takes this path only where one node can stand for it (``one_node``): its output is a
tensor or a tuple of tensors of floating dtype, none of them sharing storage with an input, and
every parameter its graph reaches is its own, so the inputs and its own parameters are all that
its gradients flow to. The profile judges each unit as it runs (``TraceUnit.one_node``), the
planner keeps checkpointing for a unit whose forward runs long after its last save (NOTE [one
node or checkpointing] in ``planner/recompute.py``), and a plan names the units it recomputes
this way (``Plan.one_node``), so that the iterations a plan
is made from and its replays hold the same bytes; the others stay with torch's checkpointing.
What one node holds that checkpointing does not is the unit's output gradient, which the engine
keeps until the node's backward returns: the planner counts it (``TraceUnit.output_bytes``).
The manager's hooks see the same steps either way (the rebuilt graph's backward boundaries are
marked as the first forward's would have been, ``Boundaries.mark``).
"""

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils.checkpoint import get_device_states, set_device_states

from vtensor.activations.encodings import saved_hooks_in_force
from vtensor.errors import InPlaceModificationError, VTensorError

REBUILT_KEY = "vtensor.rebuilt"  # in the metadata of a Rebuild node (NOTE [one-node recomputation])
_MAX_GRAPH_NODES = 100_000


class Boundaries(Protocol):
    """The module hooks that mark a step's boundaries (``hooks.ModuleHooks``)."""

    rebuilding: int  # above 0 while a unit's graph is rebuilt in backward: its modules mark it

    def mark(self, module: nn.Module, output: Any) -> None:
        """Give the nodes that made ``output`` the backward boundary of ``module``."""
        ...


class RebuildHost(Protocol):
    """The iteration a rebuilt graph belongs to."""

    boundaries: Boundaries | None  # None: no module hooks (a replay without them)


class Rerun:
    """What a ``Rebuild`` node runs: the forward on the caller's arguments, then again."""

    def __init__(
        self,
        first: Callable[[], Any],
        context: Callable[[], contextlib.AbstractContextManager[Any]],
        rerun: Callable[[Sequence[torch.Tensor]], Any],
        finish: Callable[[], None],
        count: int,
        params: Sequence[torch.Tensor],
    ) -> None:
        self.first = first  # the forward itself
        self.context = context  # what the second run runs in (the manager's recomputation)
        self.rerun = rerun  # the forward from the saved inputs
        self.finish = finish  # once the rebuilt graph has given its gradients
        self.count = count  # how many of the node's inputs are the call's tensors
        self.params = params  # the unit's own parameters that require grad
        self.rng = torch.get_rng_state()
        self.device_type = "cpu"
        self.devices: list[int] = []
        self.device_states: list[torch.Tensor] = []
        self.autocast: dict[str, tuple[bool, torch.dtype, bool]] = {}

    def note_state(self, tensors: Sequence[torch.Tensor]) -> None:
        """Keep the RNG and autocast state the forward runs in."""
        device_type = next((t.device.type for t in tensors if t.device.type != "cpu"), "cpu")
        self.device_type = device_type
        if device_type != "cpu":
            module = getattr(torch, device_type, None)
            if getattr(module, "_initialized", False):  # never initialise a device here
                self.devices, self.device_states = get_device_states(*tensors)
        cache = torch.is_autocast_cache_enabled()
        for kind in {"cpu", device_type}:
            if torch.amp.is_autocast_available(kind):
                dtype = torch.get_autocast_dtype(kind)
                self.autocast[kind] = (torch.is_autocast_enabled(kind), dtype, cache)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """The forward's RNG and autocast state, around the second run."""
        with torch.random.fork_rng(devices=self.devices, device_type=self.device_type):
            torch.set_rng_state(self.rng)
            if self.devices:
                set_device_states(self.devices, self.device_states, device_type=self.device_type)
            with contextlib.ExitStack() as stack:
                for kind, (enabled, dtype, cache) in self.autocast.items():
                    stack.enter_context(
                        torch.amp.autocast(kind, enabled=enabled, dtype=dtype, cache_enabled=cache)
                    )
                yield


class _Held:
    """What the rebuilt graph holds for a saved tensor: given up at its unpack."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.version = tensor._version


def _hold(tensor: torch.Tensor) -> _Held:
    return _Held(tensor)


def _give_up(held: _Held) -> torch.Tensor:
    # As torch's checkpointing gives up what it recomputed: a tensor is freed once the node
    # that unpacked it is done with it, not when the whole graph is.
    tensor, held.tensor = held.tensor, None
    if tensor is None:
        raise VTensorError(
            "a tensor saved in a unit rebuilt for backward was unpacked twice; recompute this "
            "model with recompute=False"
        )
    if tensor._version != held.version:
        raise InPlaceModificationError(
            f"a tensor of shape {tuple(tensor.shape)} saved in a recomputed unit was modified in "
            "place after it was saved: use the out-of-place op"
        )
    return tensor


class _Inner(threading.local):
    depth = 0  # Rebuild backwards running inside one another on this thread
    owed: list[Callable[[], None]]

    def __init__(self) -> None:
        self.owed = []


_INNER = _Inner()


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the outermost backward running now ends.

    NOTE [end of backward]
    autograd runs a callback queued during a backward (``queue_callback``) when the graph task
    it was queued in ends. A ``Rebuild`` node's backward runs its rebuilt graph by a backward of
    its own, a graph task inside the outer one, and the module boundaries of the rebuilt graph
    begin steps in there: where the first backward step an iteration saw was one of them (a
    sparse replay whose first acting backward step lay in a unit recomputed through one node),
    the end of backward was marked when that unit's backward ended. The sparse replay then took
    its acting steps still to come for never reached and left its plan; on ResNet-18 at 80 % of
    its peak the race holding that plan started over after 15 steps. A callback asked for in
    there is queued once the outermost ``Rebuild`` backward returns to the graph task around it.
    """
    if _INNER.depth:
        _INNER.owed.append(callback)
    else:
        torch.autograd.Variable._execution_engine.queue_callback(callback)


@contextlib.contextmanager
def _inner_backward() -> Iterator[None]:
    """A rebuilt graph's own backward runs (NOTE [end of backward])."""
    _INNER.depth += 1
    try:
        yield
    finally:
        _INNER.depth -= 1
        if not _INNER.depth:
            owed, _INNER.owed = _INNER.owed, []
            for callback in owed:  # in the outer graph task again: it ends the backward
                torch.autograd.Variable._execution_engine.queue_callback(callback)


def _own_hooks() -> contextlib.AbstractContextManager[Any]:
    """The rebuilt graph's saved-tensor hooks, in front of any in force (NOTE [own hooks])."""
    # NOTE [own hooks]: under the manager's saved-tensor hooks (a profile, a full or checking
    # replay), the rebuilt graph's saved tensors would go through them as new saved tensors;
    # the node's own hooks stand in front and give each up at its unpack. Where no hooks are in
    # force (a quiet replay, NOTE [quiet replay]), the graph saves as autograd does: the engine
    # releases a node's saved tensors once it has run, as the hooks would, without two Python
    # calls per saved tensor, and the clamps in the unit take their hooked form (NOTE [hooked
    # clamps]) instead of the autograd Function. Autograd then checks in-place changes itself.
    if not saved_hooks_in_force():
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_hold, _give_up)


class Rebuild(torch.autograd.Function):
    """One node for a recomputed unit (NOTE [one-node recomputation])."""

    @staticmethod
    def forward(ctx: Any, run: Rerun, *tensors: torch.Tensor) -> Any:
        """The unit's forward without autograd; its tensor inputs saved for the second run."""
        ctx.run = run
        ctx.set_materialize_grads(False)  # an output with no gradient adds none
        ctx.save_for_backward(*tensors[: run.count])
        return run.first()

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """The forward again with autograd, and the gradients of what it rebuilt."""
        run: Rerun = ctx.run
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        try:
            with (
                run.restored(),
                torch.enable_grad(),
                run.context(),
                _own_hooks(),
            ):
                output = run.rerun(inputs)
                outputs = output if isinstance(output, tuple) else (output,)
                pairs = [
                    (get_gradient_edge(o), g)
                    for o, g in zip(outputs, grads, strict=True)
                    if g is not None and o.requires_grad
                ]
                # The output itself is not needed, only where its gradient enters the graph:
                # freed before the recomputation's growth is read (checkpointing never makes it).
                del output, outputs
            wanted = [t for t in inputs if t.requires_grad] + list(run.params)
            found: list[torch.Tensor | None] = [None] * len(wanted)
            if pairs and wanted:
                with _inner_backward():
                    found = list(
                        torch.autograd.grad(
                            [o for o, _ in pairs],
                            wanted,
                            [g for _, g in pairs],
                            allow_unused=True,
                            create_graph=torch.is_grad_enabled(),  # a double backward
                        )
                    )
        finally:
            run.finish()
        given = iter(found)  # the inputs' gradients first, in order, then the parameters'
        per_input = [next(given) if t.requires_grad else None for t in inputs]
        return (None, *per_input, *given)


def one_node(module: nn.Module, output: Any, inputs: Sequence[torch.Tensor]) -> bool:
    """Whether one ``Rebuild`` node can stand for ``module`` (NOTE [one-node recomputation]).

    ``output`` is what its forward returned, with its graph (the profiled iteration's);
    ``inputs`` the tensors it was given.
    """
    outputs = output if type(output) is tuple else (output,)
    if not outputs or not all(
        type(o) is torch.Tensor and (o.is_floating_point() or o.is_complex()) for o in outputs
    ):
        return False
    storages = {t.untyped_storage().data_ptr() for t in inputs}
    if any(o.untyped_storage().data_ptr() in storages for o in outputs):
        return False
    own = {id(p) for p in module.parameters()} | {id(t) for t in inputs}
    stops = {id(t.grad_fn) for t in inputs if t.grad_fn is not None}
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or id(node) in stops:
            continue
        seen.add(id(node))
        if len(seen) > _MAX_GRAPH_NODES:
            return False
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) not in own:
            return False  # a parameter not its own: its gradient would not reach it
        stack.extend(n for n, _ in node.next_functions)
    return True
