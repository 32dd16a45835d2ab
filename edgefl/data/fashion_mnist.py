"""Fashion-MNIST from Debian's ``dataset-fashion-mnist`` package (IDX files), 1x28x28."""

import gzip
from pathlib import Path

import numpy as np

from edgefl.data.arrays import ArrayDataset, DataKind, DatasetBundle, DatasetInfo, check_split
from edgefl.data.package_files import directory_file
from edgefl.errors import DatasetCorruptError

DEFAULT_ROOT = Path("/usr/share/datasets/fashion-mnist")
INSTALL_HINT = "apt-get install -y --no-install-recommends dataset-fashion-mnist  (Debian, as root)"
INFO = DatasetInfo(
    name="fashion_mnist", kind=DataKind.IMAGE, example_shape=(1, 28, 28), num_classes=10
)
_MEAN, _STD = 0.2860, 0.3530


def load_fashion_mnist(root: Path | None = None) -> DatasetBundle:
    """Load Fashion-MNIST from ``root`` (default /usr/share/datasets/fashion-mnist)."""
    folder = DEFAULT_ROOT if root is None else root
    splits = []
    for prefix, count in (("train", 60_000), ("t10k", 10_000)):
        images = _read_idx(_file(folder, f"{prefix}-images-idx3-ubyte.gz"))
        labels = _read_idx(_file(folder, f"{prefix}-labels-idx1-ubyte.gz"))
        x = (images.reshape(-1, 1, 28, 28).astype(np.float32) / 255.0 - _MEAN) / _STD
        split = ArrayDataset(x, labels.astype(np.int64))
        check_split(
            "fashion_mnist",
            split,
            example_shape=INFO.example_shape,
            num_classes=10,
            min_examples=count,
        )
        splits.append(split)
    return DatasetBundle(INFO, splits[0], splits[1])


def _file(folder: Path, name: str) -> Path:
    return directory_file(folder, name, dataset="fashion_mnist", install_hint=INSTALL_HINT)


def _read_idx(path: Path) -> np.ndarray:
    """Parse one gzipped IDX file (big-endian header: magic, dims) into a uint8 array."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DatasetCorruptError(f"{path} is not an unsigned-byte IDX file; reinstall the package")
    ndim = raw[3]
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise DatasetCorruptError(f"{path} holds {data.size} bytes of data for dims {dims}")
    return data.reshape(dims)
