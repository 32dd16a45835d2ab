"""In-memory datasets as plain numpy arrays, with the checks every loader applies."""

from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from edgefl.errors import DatasetCorruptError


class DataKind(StrEnum):
    """What one example is; models use it to refuse data they cannot take."""

    IMAGE = "image"  # x: (n, channels, height, width) float32
    SENSOR = "sensor"  # x: (n, channels, length) float32
    TOKENS = "tokens"  # x: (n, seq_len) int64, y: (n, seq_len) next-token ids


@dataclass(frozen=True)
class DatasetInfo:
    """Shape facts a model needs to be built for a dataset."""

    name: str
    kind: DataKind
    example_shape: tuple[int, ...]
    num_classes: int  # classes, or vocabulary size for TOKENS
    # what the central accuracy counts, as every printed line, table and plot names it
    accuracy: str = "accuracy"


@dataclass(frozen=True)
class ArrayDataset:
    """Examples ``x``, labels ``y`` and, for naturally partitioned data, a group id per example."""

    x: np.ndarray
    y: np.ndarray
    groups: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def subset(self, indices: np.ndarray) -> "ArrayDataset":
        """Return the examples at ``indices`` (in that order)."""
        groups = None if self.groups is None else self.groups[indices]
        return ArrayDataset(self.x[indices], self.y[indices], groups)


@dataclass(frozen=True)
class DatasetBundle:
    """A dataset split into the part clients train on and the part the server evaluates on."""

    info: DatasetInfo
    train: ArrayDataset
    test: ArrayDataset


def check_split(
    name: str,
    split: ArrayDataset,
    *,
    example_shape: tuple[int, ...],
    num_classes: int,
    min_examples: int,
) -> None:
    """Raise DatasetCorruptError unless ``split`` has the shapes, count and label range expected."""
    n = len(split)
    if n < min_examples:
        raise DatasetCorruptError(
            f"dataset {name!r} has {n} examples, expected at least {min_examples}; "
            "the installed files look truncated: reinstall the dataset package"
        )
    if tuple(split.x.shape[1:]) != example_shape:
        raise DatasetCorruptError(
            f"dataset {name!r} examples have shape {tuple(split.x.shape[1:])}, "
            f"expected {example_shape}; reinstall the dataset package"
        )
    if split.y.shape[0] != n:
        raise DatasetCorruptError(
            f"dataset {name!r} has {n} examples but {split.y.shape[0]} labels"
        )
    if split.y.size and (int(split.y.min()) < 0 or int(split.y.max()) >= num_classes):
        raise DatasetCorruptError(
            f"dataset {name!r} labels span [{int(split.y.min())}, {int(split.y.max())}], "
            f"expected [0, {num_classes - 1}]"
        )
