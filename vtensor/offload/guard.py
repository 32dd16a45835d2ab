"""First forward only: a parameter used while none of its units runs is an error, never a crash.

Between uses an offloaded parameter's storage holds no bytes, so an op using it outside the
forward of a module that owns it (``F.linear(h, self.embed.weight)`` in a parent) would read
freed memory. During the first forward a function mode checks every op's tensor arguments.
"""

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from vtensor.errors import ParamOffloadError
from vtensor.offload.records import ParamRecord
from vtensor.offload.units import Unit


class UseGuard(TorchFunctionMode):
    """Checks that every managed parameter an op receives belongs to a running unit."""

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
