"""How far each unit's forward took the bytes (NOTE [recomputation's working set])."""

from vtensor.activations.recompute.profile.highs import UnitHighs


def test_nested_units_that_begin_at_the_same_reading_end_apart() -> None:
    """Page-granular readings often repeat: watches must be told apart by identity."""
    highs = UnitHighs()
    highs.note(4096)
    outer, inner = highs.begin(), highs.begin()
    highs.note(3 * 4096)
    assert highs.end(inner) == 2 * 4096
    highs.note(5 * 4096)
    assert highs.end(outer) == 4 * 4096
