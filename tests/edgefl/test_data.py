from pathlib import Path

import numpy as np
import pytest

from edgefl.data import ArrayDataset, load_dataset
from edgefl.data.arrays import check_split
from edgefl.data.fashion_mnist import DEFAULT_ROOT, load_fashion_mnist
from edgefl.data.hapt import load_hapt
from edgefl.data.mnist import load_mnist
from edgefl.data.shakespeare import encode, load_shakespeare
from edgefl.errors import ConfigError, DatasetCorruptError, DatasetMissingError


def test_mnist_loads_verified_splits() -> None:
    bundle = load_dataset("mnist")
    assert bundle.train.x.shape == (60_000, 1, 28, 28) and bundle.test.x.shape == (
        10_000,
        1,
        28,
        28,
    )
    assert bundle.train.x.dtype == np.float32
    assert set(np.unique(bundle.test.y).tolist()) == set(range(10))


def test_hapt_groups_are_subjects_with_held_out_test_subjects() -> None:
    bundle = load_hapt()
    assert bundle.train.x.shape[1:] == (6, 128)
    assert bundle.train.groups is not None and bundle.test.groups is not None
    assert set(np.unique(bundle.train.groups).tolist()) == set(range(1, 25))
    assert set(np.unique(bundle.test.groups).tolist()) == set(range(25, 31))
    assert len(bundle.train) + len(bundle.test) == 10_017
    assert set(np.unique(bundle.train.y).tolist()) == set(range(6))


@pytest.mark.skipif(not DEFAULT_ROOT.is_dir(), reason="Debian dataset-fashion-mnist not installed")
def test_fashion_mnist_loads_from_debian_package() -> None:
    bundle = load_fashion_mnist()
    assert len(bundle.train) == 60_000 and len(bundle.test) == 10_000
    assert np.bincount(bundle.train.y).tolist() == [6000] * 10


def test_shakespeare_sequences_predict_the_next_character() -> None:
    bundle = load_shakespeare(seq_len=40)
    assert bundle.train.x.shape[1:] == (40,)
    assert np.array_equal(bundle.train.x[0, 1:], bundle.train.y[0, :-1])
    assert bundle.train.groups is not None and len(np.unique(bundle.train.groups)) > 300
    assert encode("A a~\n").tolist() == [34, 1, 66, 95, 0]


@pytest.mark.parametrize("loader", [load_mnist, load_fashion_mnist, load_hapt])
def test_missing_dataset_names_the_install_command(loader, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(DatasetMissingError, match="install it with"):
        loader(tmp_path)


def test_unknown_dataset_lists_choices() -> None:
    with pytest.raises(ConfigError, match="mnist"):
        load_dataset("cifar10")


def test_check_split_rejects_bad_labels_and_shapes() -> None:
    good = ArrayDataset(np.zeros((5, 2), np.float32), np.array([0, 1, 2, 0, 1]))
    check_split("t", good, example_shape=(2,), num_classes=3, min_examples=5)
    with pytest.raises(DatasetCorruptError, match="labels span"):
        check_split("t", good, example_shape=(2,), num_classes=2, min_examples=5)
    with pytest.raises(DatasetCorruptError, match="shape"):
        check_split("t", good, example_shape=(3,), num_classes=3, min_examples=5)
    with pytest.raises(DatasetCorruptError, match="at least 6"):
        check_split("t", good, example_shape=(2,), num_classes=3, min_examples=6)
