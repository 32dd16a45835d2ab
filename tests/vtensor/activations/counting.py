"""Counting the calls of a function a test patches."""

from typing import Any

import pytest


def count_calls(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[int]:
    """Counts the calls of ``owner.name`` (one entry per call) for the test's length."""
    seen: list[int] = []
    original = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        seen.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return seen
