"""First forward of demand layering: using an unloaded tensor is an error that names the fix."""

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from vtensor.errors import LayeringError


class Discovery(TorchFunctionMode):
    """First forward only: turns the use of an unloaded tensor into a LayeringError.

    A function mode sees the parameters themselves and costs no imports (a dispatch mode pulls
    in sympy). Reading metadata such as ``.shape`` is no use.
    """

    def __init__(self, owners: dict[int, tuple[str, str]], running: list[str]) -> None:
        super().__init__()
        self.owners = owners  # placeholder storage -> (tensor name, its module's name)
        self.running = running  # names of the modules whose forward is running, innermost last

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        metas = (
            t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_meta
        )
        owner = next(
            filter(None, (self.owners.get(t.untyped_storage()._cdata) for t in metas)), None
        )
        if owner is None:
            return func(*args, **(kwargs or {}))
        try:
            result = func(*args, **(kwargs or {}))
        except Exception:
            result = torch.empty(0)  # failed on the placeholder: a use
        if not isinstance(result, torch.Tensor):
            return result
        user = self.running[-1] if self.running else ""
        raise LayeringError(
            f"tensor {owner[0]!r} is used in the forward of module {user!r}, outside the "
            f"forward of its own module {owner[1]!r} (a tied weight used functionally, or a "
            f"parent reading a child's tensor): pass resident=[{owner[1]!r}] to keep it loaded, "
            f"or group=[{user!r}] to load it with that module as one layer"
        )
