"""Torch glue: saved-tensor pack/unpack hooks and module boundary hooks. They only route events.

NOTE [own time]
A profiled step's duration is the model's compute (NOTE [calibrated model]), so on the CPU the time
the hooks spend in the manager (readings, books, evictions, waits for transfers) is left out of
it, as the recomputation checks' is: the model adds the waits it predicts and the swap engine's
CPU time per byte itself. On CUDA the host's hook time overlaps queued device work: it stays.
"""

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, TypeVar

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from vtensor.activations.replay.lean import Passing
from vtensor.activations.runtime.admission import Admission
from vtensor.activations.store.chunk_store import ChunkStore, VTensor
from vtensor.errors import InPlaceModificationError
from vtensor.outputs import tensors_in


class HookTarget(Protocol):
    """What the hooks report to (the session)."""

    store: ChunkStore
    step_index: int
    recomputing: int  # above 0 while a forward runs again (NOTE [recompute])
    admission: Admission  # which saved tensors are activations, and which of them it manages
    own_time_excluded: bool  # NOTE [own time]

    def exclude_time(self, seconds: float) -> None:
        """Leave ``seconds`` out of the open step's duration."""
        ...

    def accepts(self, tensor: torch.Tensor, storage: torch.UntypedStorage) -> bool:
        """Whether ``tensor``, plain for ``admission`` with ``storage``, may be virtualized."""
        ...

    @property
    def passing(self) -> Passing | None:
        """While a lean replay lasts, what it leaves to autograd (NOTE [passed])."""
        ...

    def on_pack(self, record: VTensor, tensor: torch.Tensor) -> None:
        """A saved tensor was adopted into ``record``."""
        ...

    def before_unpack(self, record: VTensor) -> None:
        """Backward is about to use ``record``: make room for it."""
        ...

    def after_unpack(self, record: VTensor) -> None:
        """Backward has the bytes of ``record``."""
        ...

    def begin_step(self, name: str) -> None:
        """A module boundary was crossed."""
        ...

    def after_node(self) -> None:
        """A backward node has computed its gradients; its inputs and outputs are still alive."""
        ...


class SavedHandle:
    """What autograd holds instead of a saved tensor: the record and a detached alias.

    The alias shares the version counter, so an in-place change is seen at unpack, and keeps
    the exact view over the storage. Its death releases the record.
    """

    __slots__ = ("alias", "record", "store", "version")

    def __init__(self, store: ChunkStore, record: VTensor, tensor: torch.Tensor) -> None:
        self.store = store
        self.record = record
        self.alias: torch.Tensor | None = tensor.detach()
        self.version = tensor._version
        record.handles += 1

    def __del__(self) -> None:
        self.alias = None
        self.store.drop_handle(self.record)


def make_saved_tensor_hooks(
    target: HookTarget,
) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
    """The (pack, unpack) pair for ``torch.autograd.graph.saved_tensors_hooks``."""

    def pack(tensor: torch.Tensor) -> Any:
        storage = target.admission.storage(tensor)
        if storage is None:
            # State (changed in place by the optimizer) and other devices' tensors: left as is.
            return tensor
        if not target.accepts(tensor, storage):
            # Saved-tensor hooks turn autograd's in-place check off: check the version at unpack.
            return (tensor, tensor._version, None)
        passing = target.passing
        position = passing.passes(storage) if passing is not None else None
        if position is not None:  # NOTE [passed]
            return (tensor, tensor._version, position)
        record = target.store.adopt(storage, step=target.step_index)
        if not record.fully_resident():
            target.store.ensure_resident(record)
        handle = SavedHandle(target.store, record, tensor)
        target.on_pack(record, tensor)
        return handle

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, tuple):
            passed, version, position = packed
            if passed._version != version:
                _check_version(passed, version)
            passing = target.passing
            if passing is not None and passing.reading and position is not None:
                passing.unpacked(position)
            return passed  # type: ignore[no-any-return]
        handle: SavedHandle = packed
        target.before_unpack(handle.record)
        target.store.ensure_resident(handle.record)
        alias = handle.alias
        assert alias is not None
        _check_version(alias, handle.version)
        target.after_unpack(handle.record)
        # A fresh alias per unpack: while backward holds it, the use count pins the record.
        return alias.detach()

    return _timed(pack, target), _timed(unpack, target)


R = TypeVar("R")


def _timed(handler: Callable[..., R], target: HookTarget) -> Callable[..., R]:
    """``handler``, its time left out of the open step where the target says so."""
    if not target.own_time_excluded:
        return handler

    def timed(*args: Any) -> R:
        began = time.perf_counter()
        try:
            return handler(*args)
        finally:
            target.exclude_time(time.perf_counter() - began)  # NOTE [own time]

    return timed


def _check_version(saved: torch.Tensor, version: int) -> None:
    """Raise if ``saved`` changed in place since it was saved at ``version``."""
    if saved._version != version:
        raise InPlaceModificationError(
            f"a tensor of shape {tuple(saved.shape)} and dtype {saved.dtype} saved for "
            f"backward was modified in place after it was saved (version {version} "
            f"at save, {saved._version} now). Autograd would compute a wrong gradient: "
            "use the out-of-place op, or .clone() the tensor before modifying it."
        )


_SAMPLED_KEY = "vtensor.node_sampler"  # see NOTE [sampled nodes]
_BOUNDARY_KEY = "vtensor.boundary"


class _NodeSampler:
    """Post-hooks on the backward nodes of the step's graph, so the tracker samples their peak.

    NOTE [node peaks]: a backward node holds its incoming gradients, saved tensors and outputs
    at once, freed before the next hook point; a post-hook samples before that. AccumulateGrad
    gets none: it would keep the incoming gradient referenced and make it copied, not stolen.
    """

    def __init__(self, target: HookTarget) -> None:
        self.target = target
        # NOTE [sampled nodes]: a hooked node is marked in its own metadata, not kept in a set:
        # freed nodes' ids are reused, and holding nodes would keep alive graphs never run.
        self._token = object()
        self._handles: list[RemovableHandle] = []
        self._hook = _timed(self._after, target)

    def add_graph_of(self, tensors: Iterable[torch.Tensor]) -> None:
        """Hook every node of the graph behind ``tensors`` not hooked yet."""
        stack: list[Any] = [t.grad_fn for t in tensors if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            # AccumulateGrad: a leaf, living as long as its parameter; neither hooked nor marked.
            if node is None or node.name() == "torch::autograd::AccumulateGrad":
                continue
            metadata = node.metadata
            if metadata.get(_SAMPLED_KEY) is self._token:
                continue
            metadata[_SAMPLED_KEY] = self._token
            self._handles.append(node.register_hook(self._hook))
            stack.extend(next_node for next_node, _ in node.next_functions)  # None: a leaf

    def _after(self, _grad_inputs: Any, _grad_outputs: Any) -> None:
        self.target.after_node()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class ModuleHooks:
    """The module boundary hooks of one step (``install_module_hooks``)."""

    def __init__(self, names: Mapping[int, str], target: HookTarget, sample_nodes: bool) -> None:
        self._forward = {key: f"forward:{name}" for key, name in names.items()}
        self._backward = {key: f"backward:{name}" for key, name in names.items()}
        self._target = target
        self._sampler = _NodeSampler(target) if sample_nodes else None
        # Marks in node metadata, by this step's token: node ids are reused.
        self._token = object()
        self._handles = [
            register_module_forward_pre_hook(_timed(self._pre, target)),
            register_module_forward_hook(_timed(self._post, target)),
        ]

    def _pre(self, module: nn.Module, _args: Any) -> None:
        name = self._forward.get(id(module))
        if name is not None and not self._target.recomputing:
            self._target.begin_step(name)

    def _post(self, module: nn.Module, _args: Any, output: Any) -> None:
        if not self._target.recomputing:
            self.mark(module, output)

    def mark(self, module: nn.Module, output: Any) -> None:
        """Give the nodes that made ``output`` the backward boundary of ``module``, if unmarked."""
        name = self._backward.get(id(module))
        if name is None:
            return
        tensors = tensors_in(output)
        if self._sampler is not None:
            self._sampler.add_graph_of(tensors)
        target = self._target
        for tensor in tensors:
            node: Any = tensor.grad_fn
            if node is None:
                continue
            metadata = node.metadata
            if metadata.get(_BOUNDARY_KEY) is self._token:
                continue
            metadata[_BOUNDARY_KEY] = self._token

            def on_backward(_grads: Any, name: str = name) -> None:
                target.begin_step(name)

            node.register_prehook(_timed(on_backward, target))

    def remove(self) -> None:
        """Take every hook off."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._sampler is not None:
            self._sampler.remove()


def install_module_hooks(
    names: Mapping[int, str], target: HookTarget, *, sample_nodes: bool = True
) -> ModuleHooks:
    """Mark forward and backward step boundaries of every module of a model.

    Global module hooks leave nothing on the model. Backward boundaries are pre-hooks on the
    output nodes: full backward hooks would wrap the outputs and break in-place modules.
    """
    return ModuleHooks(names, target, sample_nodes)
