"""The tensors inside a module's output, for the hooks of every feature."""

from typing import Any

import torch


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a module output (nested tuples, lists and dicts), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []
