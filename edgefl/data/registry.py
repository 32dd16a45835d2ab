"""Dataset names -> loaders, with a per-process cache so virtual clients load each dataset once."""

import functools
from collections.abc import Callable
from pathlib import Path

from edgefl.data.arrays import DatasetBundle
from edgefl.data.fashion_mnist import load_fashion_mnist
from edgefl.data.hapt import load_hapt
from edgefl.data.mnist import load_mnist
from edgefl.data.shakespeare import load_shakespeare
from edgefl.errors import ConfigError

_LOADERS: dict[str, Callable[[Path | None, int], DatasetBundle]] = {
    "mnist": lambda root, _seq: load_mnist(root),
    "fashion_mnist": lambda root, _seq: load_fashion_mnist(root),
    "hapt": lambda root, _seq: load_hapt(root),
    "shakespeare": lambda root, seq_len: load_shakespeare(root, seq_len=seq_len),
}
DATASET_NAMES = tuple(_LOADERS)


@functools.lru_cache(maxsize=2)
def load_dataset(name: str, root: str | None = None, seq_len: int = 80) -> DatasetBundle:
    """Load dataset ``name`` (cached per process; the arrays must be treated as read-only)."""
    if name not in _LOADERS:
        raise ConfigError(f"dataset={name!r} is unknown; choose one of {', '.join(DATASET_NAMES)}")
    return _LOADERS[name](Path(root) if root else None, seq_len)
