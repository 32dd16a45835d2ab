"""Shared pytest fixtures: a per-test storage directory and single-threaded torch."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _torch_single_thread() -> Iterator[None]:
    # CI has 2 cores; one intra-op thread keeps runs fast, repeatable and free of oversubscription.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def tmp_storage_dir(tmp_path: Path) -> Path:
    """An empty directory for a memory manager's swap file, removed with the test's tmp_path."""
    storage = tmp_path / "storage"
    storage.mkdir()
    return storage
