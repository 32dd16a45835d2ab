import numpy as np
import pytest

from edgefl.data import ArrayDataset, Partitioner, partition_indices
from edgefl.errors import PartitionError


def _data(n: int = 1000, classes: int = 10, groups: int | None = None) -> ArrayDataset:
    rng = np.random.default_rng(0)
    g = None if groups is None else rng.integers(0, groups, n)
    return ArrayDataset(rng.normal(size=(n, 3)).astype(np.float32), rng.integers(0, classes, n), g)


@pytest.mark.parametrize("method", [Partitioner.IID, Partitioner.DIRICHLET, Partitioner.NATURAL])
def test_partition_covers_every_example_once(method: Partitioner) -> None:
    parts = partition_indices(_data(groups=20), 5, method=method, seed=1)
    joined = np.concatenate(parts)
    assert len(parts) == 5
    assert np.array_equal(np.sort(joined), np.arange(1000))


@pytest.mark.parametrize("method", [Partitioner.IID, Partitioner.DIRICHLET, Partitioner.NATURAL])
def test_partition_is_deterministic_for_a_seed(method: Partitioner) -> None:
    a = partition_indices(_data(groups=20), 4, method=method, seed=3)
    b = partition_indices(_data(groups=20), 4, method=method, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_label_split_keeps_the_split_labels_in_the_first_partitions() -> None:
    data = _data(1000, classes=10)
    parts = partition_indices(
        data, 5, method=Partitioner.LABEL_SPLIT, seed=0, split_labels=(0, 1), split_partitions=2
    )
    assert all(set(np.unique(data.y[p])) <= {0, 1} for p in parts[:2])
    assert all(not set(np.unique(data.y[p])) & {0, 1} for p in parts[2:])
    assert all(len(set(np.unique(data.y[p]))) == 8 for p in parts[2:])  # IID within the group
    with pytest.raises(PartitionError, match="split_partitions"):
        partition_indices(data, 5, method=Partitioner.LABEL_SPLIT, seed=0, split_labels=(0,))


def test_dirichlet_small_alpha_skews_labels() -> None:
    data = _data(5000)
    parts = partition_indices(data, 5, method=Partitioner.DIRICHLET, seed=0, alpha=0.05)
    dominant = [np.bincount(data.y[p], minlength=10).max() / len(p) for p in parts]
    assert max(dominant) > 0.3  # IID would give ~0.1
    assert min(len(p) for p in parts) >= 10


def test_natural_keeps_groups_whole() -> None:
    data = _data(groups=12)
    parts = partition_indices(data, 5, method=Partitioner.NATURAL, seed=0)
    owners = [set(data.groups[p].tolist()) for p in parts]  # type: ignore[index]
    for i, a in enumerate(owners):
        for b in owners[i + 1 :]:
            assert not a & b


def test_natural_without_groups_says_which_partitioner_to_use() -> None:
    with pytest.raises(PartitionError, match="iid or dirichlet"):
        partition_indices(_data(), 2, method=Partitioner.NATURAL, seed=0)


def test_natural_with_too_few_groups_names_the_limit() -> None:
    with pytest.raises(PartitionError, match="at most 3 clients"):
        partition_indices(_data(groups=3), 5, method=Partitioner.NATURAL, seed=0)


def test_dirichlet_rejects_bad_alpha() -> None:
    with pytest.raises(PartitionError, match="alpha"):
        partition_indices(_data(), 2, method=Partitioner.DIRICHLET, seed=0, alpha=0.0)
