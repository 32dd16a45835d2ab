"""Fixtures shared by the activation tests."""

import pytest
from counting import count_calls

from vtensor.measure import trackers


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the heap-counter readings (one entry per reading)."""
    return count_calls(monkeypatch, trackers.MallocTracker, "current_bytes")
