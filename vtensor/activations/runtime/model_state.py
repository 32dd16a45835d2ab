"""What a step holds before any activation is saved: the device, storages and bytes of state.

State is the model's parameters, buffers and gradients and the optimizer's tensors; the
manager never swaps them (``ParamOffload`` does), and with the batch they are the baseline.
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
    """The device of the model's first parameter or buffer (CPU for a model with neither).

    Given the model's scan, its tensors in the same order, without walking the modules.
    """
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

    ``tensor.device`` makes a new device object at every call (about 0.5 us), and a step tests
    every state tensor and every saved one; ``is_cpu`` and ``is_cuda`` read a flag (0.06 us).
    """
    if device.type in ("cpu", "cuda"):
        return operator.attrgetter(f"is_{device.type}")
    kind = device.type
    return lambda tensor: tensor.device.type == kind


@dataclass(frozen=True)
class ModelScan:
    """One walk over a model's modules, for everything a step needs of its structure.

    Attributes:
        names: each module's step name by ``id``: ``"model"`` for the root, else its
            qualified name.
        parameters: each parameter once (tied ones once).
        buffers: each buffer once.
        structure: what the model's architecture fingerprint depends on that can be checked
            without computing it (NOTE [fingerprint once]).
        maskable: the modules that may save their output instead of their input (NOTE
            [mask encoding] in ``activations/encode.py``).
        tensors: the part of ``structure`` that can change without a registration (NOTE
            [scan once]).
        holders: the modules' ``_parameters`` and ``_buffers`` that hold any.
        members: what ``holders`` held, in order, when the model was scanned.
        modules: each module but the root by its step name (``module`` finds the root too).
        state: ``parameters`` then ``buffers``.
        dtype: the parameters' :func:`~vtensor.planner.keys.dtype_of`, for the plan key (a
            dtype changes with a conversion, which the scan's checks see: NOTE [scan once]).
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
        # Direct members of each module (``_parameters``, ``_buffers``): the public iterators
        # walk the module tree again for every module they are called on.
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


# NOTE [scan once]: walking a model's modules costs about 2 us a module (0.45 ms a step for
# MobileNetV2's 231), a fifth of what a manager whose budget never binds adds to a short step.
# So a manager walks a model again only when a module, parameter or buffer was registered on
# any module of the process since its last walk (torch's global registration hooks see every
# assignment and ``register_*`` call) or when the scanned modules' parameters or buffers
# changed: another tensor in the module's own dict (``Module._apply`` under
# ``torch.__future__``'s overwrite on conversion puts new ones there without a registration, and
# their storages must be protected), or one deleted, or another ``requires_grad``, or another
# shape or dtype. What is read at every step is what is cheap to read together: the dicts'
# members, the parameters' ``requires_grad`` and the data pointers of the parameters and
# buffers, which the state's reading shares (NOTE [state once]). Shapes and dtypes are compared
# only when a data pointer moved: a tensor's shape or dtype changes with its data (``.data``
# assigned, ``set_``, a conversion) but for an in-place view (``p.data = p.data[:k]``,
# ``resize_`` to fewer elements). Such a change is then seen as an in-place hyperparameter
# change is (NOTE [fingerprint once]): the replay leaves its plan if what it saves differs.
# Reading shapes too cost 0.14 ms a step on MobileNetV2, most of it reaching tensors the step
# had pushed out of the caches. A module deleted without a replacement stays in the scan: its
# name is unused, which changes nothing the step does. Storages are not cached: a parameter
# whose ``.data`` was replaced is protected by its new storage at the next step.
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

    NOTE [scan once]. Holds the model weakly and drops the scan when the model goes, so neither
    the model nor its parameters outlive their last reference for the manager's sake.
    ``pointers`` are the data pointers of the scan's parameters and buffers, as :meth:`of`
    last read them.
    """

    def __init__(self) -> None:
        self._model: weakref.ref[nn.Module] | None = None
        self._registrations = -1
        self._scan: ModelScan | None = None
        self._flags: list[bool] = []
        self.pointers: list[int] = []

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
            pointers = list(map(_data_ptr, scan.state))  # map: half a comprehension's time
            if pointers == self.pointers or _tensors_structure(scan) == scan.tensors:
                self.pointers = pointers
                return scan
        self._registrations = _registrations
        self._scan = scan = ModelScan.of(model)
        self._model = weakref.ref(model, self._dropped)
        self._flags = list(map(_requires_grad, scan.parameters))
        self.pointers = list(map(_data_ptr, scan.state))
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

    NOTE [fingerprint once]: the fingerprint renders every module's record and hashes them; a
    manager computes it for a model once, and again only when the structure its scan sees
    changes (which modules, and which parameters and buffers, by identity, with their shapes,
    dtypes and ``requires_grad``). A hyperparameter changed in place between steps (a
    convolution's stride) is not seen there: the replay then diverges from its plan (the
    executor checks every saved tensor's size and every step's name), which plans it again.
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
    """The state's storages and the bytes on ``device`` of the state and ``inputs``.

    Returns the identities of the state's storages (the store never adopts them) and the bytes
    of the state's and the inputs' storages on ``device``, each storage once.
    """
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


class StateStorages:
    """A manager's :func:`state_storages`, read again only when a state tensor's data moved.

    NOTE [state once]: every step needs the identities of the state's storages (the store
    never adopts them) and their bytes (the iteration's baseline); reading a storage is a
    Python object per tensor (MobileNetV2's 630 state tensors: 0.26 ms, against 0.05 ms for
    their data pointers). A manager keeps the last reading while the state's tensors, in order,
    have the same data pointers: a storage replaced (``.data`` assigned, ``set_``) is made while
    the old one still exists, so its data lies elsewhere. Those of the parameters and buffers
    are the scan's (``ScanCache.pointers``, read with its checks). Zero-size storages, which
    may share the null pointer, make every step read again. The inputs are read at every step.
    """

    def __init__(self) -> None:
        self._last: tuple[tuple[object, ...], set[int], dict[int, int]] | None = None

    def of(
        self,
        scan: ModelScan,
        optimizer: torch.optim.Optimizer | None,
        inputs: Sequence[torch.Tensor],
        device: torch.device,
        pointers: list[int],
    ) -> tuple[set[int], int]:
        """What :func:`state_storages` returns; the set is the manager's: read it only.

        ``pointers`` are the data pointers of ``scan.state``, read at this step.
        """
        made = _made_by_steps(scan, optimizer)
        made_pointers = list(map(_data_ptr, made))
        key = (device, pointers, made_pointers)
        if self._last is None or self._last[0] != key or 0 in pointers or 0 in made_pointers:
            self._last = (key, *_state_seen([*scan.state, *made], device))
        _, protected, seen = self._last
        return protected, _with_inputs(seen, inputs, device)
