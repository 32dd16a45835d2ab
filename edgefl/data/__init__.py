"""Offline datasets as numpy arrays, and their partitioning over clients."""

from edgefl.data.arrays import ArrayDataset, DataKind, DatasetBundle, DatasetInfo
from edgefl.data.partition import Partitioner, partition_indices
from edgefl.data.registry import DATASET_NAMES, load_dataset

__all__ = [
    "DATASET_NAMES",
    "ArrayDataset",
    "DataKind",
    "DatasetBundle",
    "DatasetInfo",
    "Partitioner",
    "load_dataset",
    "partition_indices",
]
