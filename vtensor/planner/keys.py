"""Cache keys for plans: an architecture fingerprint of a model, an input signature, a PlanKey."""

import functools
import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from vtensor.errors import VTensorError

# Python scalars that may steer a forward pass (a length, a flag); their values join the signature.
_SCALAR_TYPES = (bool, int, float, str, type(None))


def _class_name(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_torch_builtin(module: nn.Module) -> bool:
    # NOTE [extra_repr in the fingerprint]: stride, padding, ``inplace`` and friends change
    # activation sizes, not parameter shapes, and torch's own modules print exactly these in
    # ``extra_repr``. User modules may print anything (values, addresses), so theirs is left out.
    return type(module).__module__.split(".")[0] == "torch"


def _tensor_records(
    module: nn.Module, prefix: str, seen: dict[int, str]
) -> Iterator[tuple[object, ...]]:
    """Direct parameters and buffers of ``module``: name, shape, dtype; tied ones by alias."""
    named: list[tuple[str, str, torch.Tensor]] = [
        ("param", n, t) for n, t in module.named_parameters(prefix, recurse=False)
    ]
    named += [("buffer", n, t) for n, t in module.named_buffers(prefix, recurse=False)]
    for kind, name, tensor in named:
        if id(tensor) in seen:
            yield (kind, name, "alias", seen[id(tensor)])
            continue
        seen[id(tensor)] = name
        grad = tensor.requires_grad if kind == "param" else False
        yield (kind, name, list(tensor.shape), str(tensor.dtype), grad)


def _module_records(model: nn.Module) -> Iterator[tuple[object, ...]]:
    """One record per module (in registration order), followed by its tensors' records."""
    seen_modules: dict[int, str] = {}
    seen_tensors: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if id(module) in seen_modules:
            yield ("module", name, "alias", seen_modules[id(module)])
            continue
        seen_modules[id(module)] = name
        extra = module.extra_repr() if _is_torch_builtin(module) else ""
        yield ("module", name, _class_name(module), extra)
        yield from _tensor_records(module, name, seen_tensors)


def architecture_fingerprint(model: nn.Module) -> str:
    """A stable SHA-256 of ``model``'s structure, never its values.

    Covers modules, torch modules' ``extra_repr``, tensor names, shapes, dtypes,
    ``requires_grad`` and weight tying.
    """
    text = json.dumps(list(_module_records(model)), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _describe(value: object) -> str:
    """Readable signature of one input leaf or container, recursively."""
    if isinstance(value, torch.Tensor):
        dims = ",".join(str(d) for d in value.shape)
        grad = "+grad" if value.requires_grad else ""
        return f"{value.dtype}[{dims}]@{value.device.type}{grad}"
    if isinstance(value, tuple | list):
        inner = ", ".join(_describe(v) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, Mapping):
        items = sorted((repr(k), _describe(v)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, _SCALAR_TYPES):
        return repr(value)
    return _class_name(value)


def input_signature(*inputs: object) -> str:
    """A readable signature of a model's inputs, e.g. ``"(torch.float32[8,3,32,32]@cpu,)"``.

    Python scalars enter by value (they can steer the forward), other objects by class name.
    """
    return _describe(inputs)


def dtype_of(parameters: Iterable[torch.Tensor]) -> str:
    """The dtype of a model's parameters (mixed: sorted and joined by ``+``; none: ``"none"``)."""
    dtypes = sorted(str(dtype) for dtype in {p.dtype for p in parameters})
    return "+".join(dtypes) if dtypes else "none"


@dataclass(frozen=True)
class PlanKey:
    """Everything a cached plan depends on; equal keys may share one plan.

    Attributes:
        dtype: :func:`dtype_of` the model's parameters.
        device_kind: torch device type the model trains on (``"cpu"``, ``"cuda"``).
        torch_version: autograd's saved tensors change between releases.
        params: ``ParamOffload.plan_signature()`` of a joint plan; empty for activations alone.
    """

    architecture: str
    input_signature: str
    dtype: str
    budget_bytes: int
    chunk_bytes: int | None
    device_kind: str
    planner_version: str
    torch_version: str = field(default=torch.__version__)
    params: str = ""

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise VTensorError(f"PlanKey budget_bytes={self.budget_bytes} must be positive")
        if self.chunk_bytes is not None and self.chunk_bytes <= 0:
            raise VTensorError(
                f"PlanKey chunk_bytes={self.chunk_bytes} must be positive "
                "(or None for whole tensors)"
            )
        if not self.device_kind or self.device_kind != self.device_kind.lower():
            raise VTensorError(
                f"PlanKey device_kind={self.device_kind!r} must be a torch device type "
                "such as 'cpu' or 'cuda'"
            )

    def digest(self) -> str:
        """SHA-256 hex digest of all fields: stable across processes, usable as a file name."""
        return _digest(self)


@functools.lru_cache(maxsize=256)
def _digest(key: PlanKey) -> str:
    # Cached: a manager makes its key at every step; rendering costs more than a lookup.
    text = json.dumps(asdict(key), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def plan_key(
    model: nn.Module,
    inputs: tuple[object, ...],
    *,
    budget_bytes: int,
    chunk_bytes: int | None,
    planner_version: str,
) -> PlanKey:
    """The :class:`PlanKey` of ``model``, one iteration's ``inputs`` and a budget."""
    first = next(model.parameters(), None)
    device_kind = first.device.type if first is not None else "cpu"
    return PlanKey(
        architecture=architecture_fingerprint(model),
        input_signature=input_signature(*inputs),
        dtype=dtype_of(model.parameters()),
        budget_bytes=budget_bytes,
        chunk_bytes=chunk_bytes,
        device_kind=device_kind,
        planner_version=planner_version,
    )
