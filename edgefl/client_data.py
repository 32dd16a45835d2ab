"""A client's share of a dataset: its partition, cut into local training and evaluation parts."""

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from edgefl.data import ArrayDataset, DatasetInfo, load_dataset, partition_indices
from edgefl.data.arrays import DataKind
from edgefl.settings import DataSettings

logger = logging.getLogger(__name__)
Split = tuple[DatasetInfo, ArrayDataset, ArrayDataset]  # info, train, local test


@functools.lru_cache(maxsize=64)
def client_split(
    settings: DataSettings, root: str | None, partition_id: int, num_partitions: int, seed: int
) -> Split:
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


# NOTE [split cache]: Flower starts a deployed node's ClientApp as a new process for every
# message, and each would decode the whole dataset to cut its partition from it: for MNIST
# 2-3 s and a few hundred MB, on a device that may have far less. A deployed node keeps its
# split in one file of its cache folder, named by a digest of everything the split depends on
# (the data settings, the data folder's files, partition, seed, this format's version),
# written atomically; a file that cannot be read is made anew.
_SPLIT_VERSION = 1


def node_split(
    settings: DataSettings,
    root: str | None,
    partition_id: int,
    num_partitions: int,
    seed: int,
    cache_dir: Path,
) -> Split:
    """``client_split``, kept in ``cache_dir`` for the node's later processes.

    See NOTE [split cache].
    """
    digest = _split_digest(settings, root, partition_id, num_partitions, seed)
    path = cache_dir / f"split-{digest}.npz"
    try:
        return _read_split(path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        logger.warning("split cache %s is unreadable (%s): making it anew", path, exc)
    split = client_split(settings, root, partition_id, num_partitions, seed)
    _write_split(path, split)
    return split


def _split_digest(
    settings: DataSettings, root: str | None, partition_id: int, num_partitions: int, seed: int
) -> str:
    files = []
    if root is not None and Path(root).is_dir():  # a data folder's files may be replaced
        files = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in Path(root).iterdir()]
    key = (_SPLIT_VERSION, settings, root, sorted(files), partition_id, num_partitions, seed)
    return hashlib.sha256(repr(key).encode()).hexdigest()[:32]


def _read_split(path: Path) -> Split:
    with np.load(path, allow_pickle=False) as f:
        info = json.loads(str(f["info"]))
        parts = [
            ArrayDataset(f[f"{p}_x"], f[f"{p}_y"], f.get(f"{p}_groups", None))
            for p in ("train", "test")
        ]
    info["kind"] = DataKind(info["kind"])
    info["example_shape"] = tuple(info["example_shape"])
    return DatasetInfo(**info), parts[0], parts[1]


def _write_split(path: Path, split: Split) -> None:
    info, train, test = split
    arrays = {"info": np.array(json.dumps(dataclasses.asdict(info)))}
    for name, part in (("train", train), ("test", test)):
        arrays[f"{name}_x"], arrays[f"{name}_y"] = part.x, part.y
        if part.groups is not None:
            arrays[f"{name}_groups"] = part.groups
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=".split-", suffix=".npz", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]  # the stub reads them as flags
        os.replace(temp, path)
    finally:
        Path(temp).unlink(missing_ok=True)
