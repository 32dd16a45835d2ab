"""Split a training set into client partitions: IID, Dirichlet(alpha), by label or natural ids.

NOTE [numpy partitioners]: flwr-datasets' partitioners work offline on a local
``datasets.Dataset`` but pull in ``datasets`` and pyarrow (~200 MB, ~4 s of import in every
client process). These three splits are a few lines of numpy, deterministic for a seed, and
need nothing beyond numpy.
"""

from enum import StrEnum

import numpy as np

from edgefl.data.arrays import ArrayDataset
from edgefl.errors import PartitionError


class Partitioner(StrEnum):
    """How examples are spread over clients."""

    IID = "iid"
    DIRICHLET = "dirichlet"
    NATURAL = "natural"
    LABEL_SPLIT = "label_split"


def partition_indices(
    data: ArrayDataset,
    num_partitions: int,
    *,
    method: Partitioner,
    seed: int,
    alpha: float = 0.5,
    min_partition_size: int = 10,
    split_labels: tuple[int, ...] = (),
    split_partitions: int = 0,
) -> list[np.ndarray]:
    """Return one sorted array of example indices per partition; together they cover ``data``."""
    if num_partitions < 1:
        raise PartitionError(f"num_partitions={num_partitions} must be at least 1")
    if len(data) < num_partitions:
        raise PartitionError(
            f"{len(data)} examples cannot fill {num_partitions} partitions; use fewer clients"
        )
    rng = np.random.default_rng(seed)
    if method is Partitioner.IID:
        parts = np.array_split(rng.permutation(len(data)), num_partitions)
    elif method is Partitioner.DIRICHLET:
        parts = _dirichlet(data.y, num_partitions, alpha, min_partition_size, rng)
    elif method is Partitioner.NATURAL:
        parts = _natural(data.groups, num_partitions, rng)
    elif method is Partitioner.LABEL_SPLIT:
        parts = _label_split(data.y, num_partitions, split_labels, split_partitions, rng)
    else:  # pragma: no cover - StrEnum exhausts the cases
        raise PartitionError(f"unknown partitioner {method!r}")
    return [np.sort(p) for p in parts]


def _dirichlet(
    labels: np.ndarray, num_partitions: int, alpha: float, min_size: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Per class, share its examples over partitions with proportions ~ Dir(alpha).

    Redraws (up to 100 times) until every partition has ``min_size`` examples, as in
    Hsu et al. 2019 and flwr-datasets' DirichletPartitioner.
    """
    if alpha <= 0:
        raise PartitionError(f"dirichlet alpha={alpha} must be positive (smaller = more skewed)")
    labels_flat = labels if labels.ndim == 1 else labels[:, 0]
    classes = np.unique(labels_flat)
    for _ in range(100):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
        for cls in classes:
            idx = rng.permutation(np.flatnonzero(labels_flat == cls))
            shares = rng.dirichlet(np.full(num_partitions, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(int)
            for pid, chunk in enumerate(np.split(idx, cuts)):
                parts[pid].append(chunk)
        merged = [np.concatenate(p) for p in parts]
        if min(len(p) for p in merged) >= min_size:
            return merged
    raise PartitionError(
        f"dirichlet(alpha={alpha}) left a partition under min_partition_size={min_size} "
        f"after 100 draws; raise alpha, lower min_partition_size or use fewer clients"
    )


def _label_split(
    labels: np.ndarray,
    num_partitions: int,
    split_labels: tuple[int, ...],
    split_partitions: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Partitions 0..split_partitions-1 share the examples of ``split_labels``, the rest the others.

    Within each group the examples are dealt at random in equal shares, so the first group's
    labels are held by its partitions only (and, in a simulated fleet, by the device classes
    that take those partition ids: classes take contiguous blocks of ids in listed order).
    """
    if not split_labels or not 0 < split_partitions < num_partitions:
        raise PartitionError(
            f"label_split needs split_labels (got {list(split_labels)}) and 0 < split_partitions "
            f"< num_partitions (got {split_partitions} of {num_partitions}); set "
            "partitioner.labels and partitioner.partitions"
        )
    labels_flat = labels if labels.ndim == 1 else labels[:, 0]
    inside = np.isin(labels_flat, split_labels)
    first = np.array_split(rng.permutation(np.flatnonzero(inside)), split_partitions)
    rest = np.array_split(
        rng.permutation(np.flatnonzero(~inside)), num_partitions - split_partitions
    )
    return [*first, *rest]


def _natural(
    groups: np.ndarray | None, num_partitions: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """One natural id (subject, role) per partition.

    With more ids than partitions, ids are dealt round-robin in a seeded order, so each
    partition holds whole ids.
    """
    if groups is None:
        raise PartitionError(
            "partitioner 'natural' needs a dataset with natural ids "
            "(hapt: subjects, shakespeare: roles); use iid or dirichlet"
        )
    ids = rng.permutation(np.unique(groups))
    if len(ids) < num_partitions:
        raise PartitionError(
            f"the dataset has {len(ids)} natural ids, fewer than "
            f"{num_partitions} partitions; use at most {len(ids)} clients"
        )
    owner = {int(gid): i % num_partitions for i, gid in enumerate(ids)}
    assignment = np.array([owner[int(g)] for g in groups])
    return [np.flatnonzero(assignment == pid) for pid in range(num_partitions)]
