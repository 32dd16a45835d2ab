"""A share of the unmanaged peak is the same bytes in every process (NOTE [budget quantum])."""

import random

from edgefl.budget import Budget


def test_peaks_a_few_kib_apart_give_one_budget() -> None:
    # Peaks the main job's clients measured in four processes: 64.8 MiB, 3.2 KiB apart.
    peaks = (67_970_982, 67_972_647, 67_973_720, 67_974_150)
    for fraction in (0.4, 0.6, 0.85):
        budgets = {Budget(peak_fraction=fraction).of_peak(p) for p in peaks}
        assert len(budgets) == 1, (fraction, budgets)


def test_the_budget_is_at_most_the_share_and_less_by_under_one_128th() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        peak = rng.randrange(1, 1 << 40)
        fraction = rng.uniform(0.01, 1.0)
        budget = Budget(peak_fraction=fraction).of_peak(peak)
        exact = max(1, int(fraction * peak))
        assert 0 < budget <= exact
        assert exact - budget <= exact / 128, (peak, fraction, budget, exact)
        step = budget & -budget  # the budget is a multiple of a power of two up to exact / 128
        assert step >= min(exact // 256, 1 << 60) or budget == exact


def test_a_budget_in_bytes_is_taken_as_given() -> None:
    assert Budget(bytes=27_188_393).of_peak(1 << 30) == 27_188_393


def test_auto_is_what_the_device_can_give() -> None:
    from edgefl.budget import parse_budget

    budget = parse_budget("auto", "fleet micro budget")
    assert budget.auto and "auto" in str(budget)
    assert budget.of_peak(1 << 20) > 1 << 20  # any machine that runs the suite has a MiB free


def test_bad_budget_forms_name_the_value_and_the_forms() -> None:
    import pytest

    from edgefl.budget import parse_budget
    from edgefl.errors import ConfigError

    for value in ("150%", "0%", "abc"):
        with pytest.raises(ConfigError, match="auto") as err:
            parse_budget(value, "--budget")
        assert repr(value) in str(err.value)
