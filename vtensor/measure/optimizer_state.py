"""How many bytes an optimizer keeps per parameter, measured on a proxy before it has stepped."""

import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StateShape:
    """Optimizer state bytes of one parameter: ``per_element`` bytes per element plus ``fixed``."""

    per_element: int
    fixed: int

    def nbytes(self, param: torch.Tensor) -> int:
        """State bytes of ``param`` once the optimizer has stepped it."""
        return self.per_element * param.numel() + self.fixed


def measure_state(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], dtype: torch.dtype
) -> StateShape:
    """Measure the state ``optimizer`` keeps per parameter of ``group``, on a 2-element proxy.

    A twin optimizer steps the proxy once: state with the proxy's element count scales with the
    parameter, the rest (Adam's ``step``) is fixed.
    """
    proxy = torch.zeros(2, dtype=dtype, requires_grad=True)
    make: Any = type(optimizer)
    twin = make([proxy])
    twin.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
    proxy.grad = torch.ones_like(proxy)
    twin.step()
    per_element = fixed = 0
    for value in twin.state[proxy].values():
        if isinstance(value, torch.Tensor):
            if value.numel() == proxy.numel():
                per_element += value.element_size()
            else:
                fixed += value.untyped_storage().nbytes()
    return StateShape(per_element, fixed)


def pending_state_bytes(
    optimizer: torch.optim.Optimizer, shapes: dict[tuple[int, torch.dtype], StateShape | None]
) -> int:
    """Bytes of state ``optimizer`` will create at its next step for parameters without any.

    ``shapes`` caches one measurement per group and dtype (None: not measurable, counted as 0).
    """
    pending = 0
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if not param.requires_grad or optimizer.state.get(param):
                continue
            key = (index, param.dtype)
            if key not in shapes:
                try:
                    shapes[key] = measure_state(optimizer, group, param.dtype)
                except Exception as error:  # any optimizer: its state stays uncounted
                    logger.debug("optimizer state not measured: %s", error)
                    shapes[key] = None
            shape = shapes[key]
            if shape is not None:
                pending += shape.nbytes(param)
    return pending
