"""Where a lean replay reads the tracked bytes (NOTE [confirmed readings])."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtensor.planner.memory_model import confirming_readings


@st.composite
def predictions(draw: st.DrawFn) -> tuple[list[int], list[int], int, int, int]:
    resident = draw(st.lists(st.integers(0, 100), min_size=1, max_size=60))
    candidates = sorted(draw(st.sets(st.integers(0, len(resident) - 1), min_size=1)))
    top = draw(st.sampled_from(candidates))
    return resident, candidates, top, draw(st.integers(0, 20)), draw(st.integers(1, 6))


@settings(max_examples=400, deadline=None)
@given(predictions())
def test_every_unread_candidate_is_confirmed_by_the_last_reading_within_the_stride(
    case: tuple[list[int], list[int], int, int, int],
) -> None:
    resident, candidates, top, slack, stride = case
    chosen = confirming_readings(resident, candidates, top, slack, stride)
    assert set(chosen) <= set(candidates)
    assert candidates[0] in chosen and top in chosen
    assert chosen == confirming_readings(resident, candidates, top, slack, stride)
    last, unread = None, 0
    for step in candidates:
        if step in chosen:
            last, unread = step, 0
            continue
        unread += 1
        assert last is not None
        # The reading before it predicts as much, to within the slack...
        assert resident[step] <= resident[last] + slack
        # ...and no more than ``stride`` candidates in a row go unread.
        assert unread <= stride


def test_a_plateau_near_the_budget_is_read_once_a_stride():
    resident = [90] * 20 + [95] + [90] * 5
    candidates = list(range(len(resident)))
    chosen = confirming_readings(resident, candidates, 20, 2, 8)
    assert chosen == (0, 9, 18, 20)


def test_readings_rise_with_the_prediction():
    resident = [10, 20, 30, 25, 26, 40]
    assert confirming_readings(resident, [0, 1, 2, 3, 4, 5], 5, 0, 8) == (0, 1, 2, 5)
    assert confirming_readings(resident, [0, 1, 2, 3, 4, 5], 5, 0, 1) == (0, 1, 2, 4, 5)


def test_a_stride_below_one_is_refused():
    with pytest.raises(ValueError, match="stride=0"):
        confirming_readings([1], [0], 0, 0, 0)
