"""A client's share of a dataset: its partition, cut into local training and evaluation parts."""

import functools
import math

import numpy as np

from edgefl.data import ArrayDataset, DatasetInfo, load_dataset, partition_indices
from edgefl.settings import DataSettings


@functools.lru_cache(maxsize=64)
def client_split(
    settings: DataSettings, root: str | None, partition_id: int, num_partitions: int, seed: int
) -> tuple[DatasetInfo, ArrayDataset, ArrayDataset]:
    """Return (info, train, local test) of one partition; deterministic for ``seed``.

    The partition is shuffled with the seed, its first ``local_test_fraction`` becomes the local
    test set and at most ``max_examples_per_client`` of the rest is kept for training.
    """
    bundle = load_dataset(settings.name, root, settings.seq_len)
    parts = partition_indices(
        bundle.train,
        num_partitions,
        method=settings.partitioner,
        seed=seed,
        alpha=settings.alpha,
        min_partition_size=settings.min_partition_size,
        split_labels=settings.split_labels,
        split_partitions=settings.split_partitions,
    )
    own = np.random.default_rng([seed, partition_id]).permutation(parts[partition_id])
    n_test = round(len(own) * settings.local_test_fraction)
    train_idx = own[n_test:]
    if settings.max_examples_per_client > 0:
        train_idx = train_idx[: settings.max_examples_per_client]
    test_idx = own[:n_test]
    if settings.max_examples_per_client > 0:  # keep the local test set in proportion
        cap = math.ceil(
            settings.max_examples_per_client
            * settings.local_test_fraction
            / max(1e-9, 1 - settings.local_test_fraction)
        )
        test_idx = test_idx[:cap]
    return bundle.info, bundle.train.subset(train_idx), bundle.train.subset(test_idx)


def central_test_set(settings: DataSettings, seed: int) -> tuple[DatasetInfo, ArrayDataset]:
    """The server's held-out test set (a seeded subset when ``central_test_examples`` > 0)."""
    bundle = load_dataset(settings.name, settings.root, settings.seq_len)
    test = bundle.test
    if 0 < settings.central_test_examples < len(test):
        idx = np.sort(
            np.random.default_rng(seed).choice(
                len(test), settings.central_test_examples, replace=False
            )
        )
        test = test.subset(idx)
    return bundle.info, test
