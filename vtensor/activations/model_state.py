"""What a step holds before any activation is saved: the device, storages and bytes of state.

State (parameters, buffers, gradients, optimizer tensors) is never swapped here; with the batch
it is the baseline.
"""

import dataclasses
import itertools
import operator
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vtensor.activations.encode import MASKABLE
from vtensor.planner.keys import architecture_fingerprint, dtype_of


def device_of(model: "nn.Module | ModelScan") -> torch.device:
    """The device of the model's (or its scan's) first parameter or buffer; CPU if none."""
    if isinstance(model, ModelScan):
        first = model.parameters[:1] or model.buffers[:1]
        return first[0].device if first else torch.device("cpu")
    for param in model.parameters():
        return param.device
    for buffer in model.buffers():
        return buffer.device
    return torch.device("cpu")


def on_device_type(device: torch.device) -> Callable[[torch.Tensor], bool]:
    """A test of whether a tensor is on a device of ``device``'s type.

    ``tensor.device`` builds a device object per call; ``is_cpu``/``is_cuda`` read a flag, and a
    step tests every state and saved tensor.
    """
    if device.type in ("cpu", "cuda"):
        return operator.attrgetter(f"is_{device.type}")
    kind = device.type
    return lambda tensor: tensor.device.type == kind


@dataclass(frozen=True)
class ModelScan:
    """One walk over a model's modules, for everything a step needs of its structure.

    Attributes:
        names: each module's step name by ``id``: ``"model"`` for the root, else its qualname.
        parameters: each parameter once (tied ones once).
        buffers: each buffer once.
        structure: what the model's architecture fingerprint depends on that can be checked
            without computing it (NOTE [fingerprint once]).
        maskable: the modules that may save their output instead (NOTE [mask encoding]).
        tensors: the part of ``structure`` that can change unregistered (NOTE [scan once]).
        holders: the modules' ``_parameters`` and ``_buffers`` that hold any.
        members: what ``holders`` held, in order, when the model was scanned.
        modules: each module but the root by its step name (``module`` finds the root too).
        state: ``parameters`` then ``buffers``.
        dtype: the parameters' :func:`~vtensor.planner.keys.dtype_of`, for the plan key.
    """

    names: dict[int, str]
    parameters: tuple[torch.Tensor, ...]
    buffers: tuple[torch.Tensor, ...]
    structure: tuple[object, ...]
    maskable: tuple[nn.Module, ...] = ()
    tensors: tuple[object, ...] = ()
    holders: tuple[dict[str, Any], ...] = ()
    members: list[object] = dataclasses.field(default_factory=list)
    # Not the root: the scan is kept beside a weak reference to it (``ScanCache``).
    modules: dict[str, nn.Module] = dataclasses.field(default_factory=dict)
    state: tuple[torch.Tensor, ...] = ()
    dtype: str = "none"

    def module(self, model: nn.Module, name: str) -> nn.Module | None:
        """The module of ``model`` (scanned as this) whose step name is ``name``, if any."""
        return model if name == "model" else self.modules.get(name)

    @classmethod
    def of(cls, model: nn.Module) -> "ModelScan":
        """Walk ``model`` once."""
        names: dict[int, str] = {}
        parameters: dict[int, torch.Tensor] = {}
        buffers: dict[int, torch.Tensor] = {}
        structure: list[object] = []
        maskable: list[nn.Module] = []
        holders: list[dict[str, Any]] = []
        modules: dict[str, nn.Module] = {}
        # Direct members: the public iterators walk the subtree again for every module.
        for qualname, module in model.named_modules():
            names[id(module)] = qualname or "model"
            if qualname:
                modules[qualname] = module
            # An empty one fills only through a registration.
            holders += [own for own in (module._parameters, module._buffers) if own]
            structure += (id(module), type(module))
            if type(module) in MASKABLE:
                maskable.append(module)
            for param in module._parameters.values():
                if param is not None:
                    parameters[id(param)] = param
                    structure.append((id(param), param.shape, param.dtype, param.requires_grad))
            for buffer in module._buffers.values():
                if buffer is not None:
                    buffers[id(buffer)] = buffer
                    structure.append((id(buffer), buffer.shape, buffer.dtype))
        scan = cls(
            names,
            tuple(parameters.values()),
            tuple(buffers.values()),
            tuple(structure),
            tuple(maskable),
            holders=tuple(holders),
            members=_members(holders),
            modules=modules,
        )
        state = (*scan.parameters, *scan.buffers)
        tensors, dtype = _tensors_structure(scan), dtype_of(scan.parameters)
        return dataclasses.replace(scan, tensors=tensors, state=state, dtype=dtype)


# NOTE [scan once]: walking every module each step costs a short step a noticeable share. So a
# model is walked again only when torch's global registration hooks saw a registration, or the
# modules' own dicts hold other tensors (a conversion may replace them without registering), or a
# ``requires_grad`` changed. Each step reads only what is cheap together: the dicts' members,
# ``requires_grad`` and the data pointers.
# Shapes and dtypes are compared only when a pointer moved, since they change with the data; an
# in-place view that keeps the pointer shows up as a divergence from the plan instead (NOTE
# [fingerprint once]).
_registrations = 0
_counting = False


def _registered(*_: object) -> None:
    global _registrations
    _registrations += 1


def _count_registrations() -> None:
    global _counting
    if not _counting:
        _counting = True
        module_hooks = torch.nn.modules.module
        module_hooks.register_module_module_registration_hook(_registered)
        module_hooks.register_module_parameter_registration_hook(_registered)
        module_hooks.register_module_buffer_registration_hook(_registered)


class ScanCache:
    """A manager's last :class:`ModelScan`, walked again only when it may be stale.

    NOTE [scan once]. Holds the model weakly, so the manager keeps neither it nor its
    parameters alive.
    """

    def __init__(self) -> None:
        self._model: weakref.ref[nn.Module] | None = None
        self._registrations = -1
        self._scan: ModelScan | None = None
        self._flags: list[bool] = []
        self._pointers: list[int] = []

    def of(self, model: nn.Module) -> ModelScan:
        """The scan of ``model``: the last one while it still holds, else a new walk."""
        _count_registrations()
        scan = self._scan
        if (
            scan is not None
            and self._model is not None
            and self._model() is model
            and self._registrations == _registrations
            and _same_members(scan)
            and list(map(_requires_grad, scan.parameters)) == self._flags
        ):
            pointers = list(map(_data_ptr, scan.state))
            if pointers == self._pointers or _tensors_structure(scan) == scan.tensors:
                self._pointers = pointers
                return scan
        self._registrations = _registrations
        self._scan = scan = ModelScan.of(model)
        self._model = weakref.ref(model, self._dropped)
        self._flags = list(map(_requires_grad, scan.parameters))
        self._pointers = list(map(_data_ptr, scan.state))
        return scan

    def _dropped(self, _: "weakref.ref[nn.Module]") -> None:
        self._scan = None


_requires_grad = operator.attrgetter("requires_grad")
_grad = operator.attrgetter("grad")
_data_ptr = torch.Tensor.data_ptr


def _tensors_structure(scan: ModelScan) -> tuple[object, ...]:
    """What the fingerprint depends on of the scanned parameters and buffers themselves."""
    parameters = [(p.shape, p.dtype, p.requires_grad) for p in scan.parameters]
    return (*parameters, *[(b.shape, b.dtype) for b in scan.buffers])


def _members(holders: Sequence[dict[str, Any]]) -> list[object]:
    """What ``holders`` hold, in order."""
    return list(_chain(map(dict.values, holders)))


def _same_members(scan: ModelScan) -> bool:
    """Whether the modules still hold the very tensors they held when scanned."""
    members = _members(scan.holders)
    return len(members) == len(scan.members) and all(map(operator.is_, members, scan.members))


_chain = itertools.chain.from_iterable


class Fingerprint:
    """A model's ``architecture_fingerprint``, computed again only when its structure changes.

    NOTE [fingerprint once]: rendering and hashing every module is costly, so it is computed
    again only when the scan's structure changes. A hyperparameter changed in place (a
    convolution's stride) is not seen there; the replay then diverges from its plan, which
    plans it again.
    """

    def __init__(self) -> None:
        self._last: tuple[tuple[object, ...], str] | None = None

    def of(self, model: nn.Module, scan: ModelScan) -> str:
        """The fingerprint of ``model``, whose scan is ``scan``."""
        if self._last is None or self._last[0] != scan.structure:
            self._last = (scan.structure, architecture_fingerprint(model))
        return self._last[1]


def state_tensors(scan: ModelScan, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Parameters, buffers, gradients and the optimizer's state tensors."""
    return [*scan.state, *_made_by_steps(scan, optimizer)]


def _made_by_steps(scan: ModelScan, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The gradients and the optimizer's state tensors: made and replaced by the steps."""
    tensors = [g for g in map(_grad, scan.parameters) if g is not None]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def state_storages(
    scan: ModelScan,
    optimizer: torch.optim.Optimizer | None,
    inputs: Sequence[torch.Tensor],
    device: torch.device,
) -> tuple[set[int], int]:
    """The state's storage identities, and the bytes on ``device`` of the state and ``inputs``."""
    protected, seen = _state_seen(state_tensors(scan, optimizer), device)
    return protected, _with_inputs(seen, inputs, device)


def _state_seen(
    tensors: Sequence[torch.Tensor], device: torch.device
) -> tuple[set[int], dict[int, int]]:
    on_device = on_device_type(device)
    protected: set[int] = set()
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        protected.add(storage._cdata)
        if on_device(tensor):
            seen[storage._cdata] = storage.nbytes()
    return protected, seen


def _with_inputs(seen: dict[int, int], inputs: Sequence[torch.Tensor], device: torch.device) -> int:
    """Bytes of the storages in ``seen`` and of those of ``inputs`` on ``device``, each once."""
    on_device = on_device_type(device)
    extra = {}
    for tensor in inputs:
        if on_device(tensor):
            storage = tensor.untyped_storage()
            if storage._cdata not in seen:
                extra[storage._cdata] = storage.nbytes()
    return sum(seen.values()) + sum(extra.values())
