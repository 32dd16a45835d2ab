"""Fixtures shared by the activation tests."""

import pytest

from vtensor.measure import trackers


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the heap-counter readings (one entry per reading)."""
    seen: list[int] = []
    read = trackers.MallocTracker.current_bytes

    def counted(self: trackers.MallocTracker) -> int:
        seen.append(1)
        return read(self)

    monkeypatch.setattr(trackers.MallocTracker, "current_bytes", counted)
    return seen
