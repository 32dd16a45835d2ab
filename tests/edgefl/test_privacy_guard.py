"""Privacy accounting and the guard: epsilon per round, and the stop before the budget."""

import itertools
from typing import Any

import numpy as np
import pytest
from flwr.serverapp.strategy import FedAvg
from privacy_messages import (
    ADAPTIVE,
    FIXED,
    LOCAL,
    N,
    aggregate_round,
    configure_train,
    train_replies,
)

from edgefl.privacy import (
    NORM_BIT_KEY,
    PrivacyBudgetExhausted,
    PrivacyGuard,
    epsilon_after,
    privacy_settings,
    wrap_strategy,
)


@pytest.mark.parametrize("raw", [FIXED, ADAPTIVE, LOCAL], ids=["fixed", "adaptive", "local"])
def test_epsilon_grows_every_round(raw: dict[str, Any]) -> None:
    privacy = privacy_settings(raw)
    strategy = wrap_strategy(FedAvg(), privacy, N)
    guard = PrivacyGuard(privacy, strategy)
    spent = [guard.epsilon()]
    for server_round in range(1, 5):
        guard.before_round(server_round)
        if privacy.central:
            sent = configure_train(strategy, server_round)
            strategy.aggregate_train(
                server_round, train_replies(sent, [np.ones(8)] * N, extra={NORM_BIT_KEY: 1})
            )
        spent.append(guard.epsilon())
    assert spent[0] == 0.0
    assert all(b is not None and a is not None and b > a for a, b in itertools.pairwise(spent))
    assert spent[-1] == pytest.approx(epsilon_after(privacy, 4), rel=1e-9)


def test_guard_stops_before_the_round_that_would_exceed_the_budget() -> None:
    target = (
        epsilon_after(privacy_settings(FIXED), 2) + epsilon_after(privacy_settings(FIXED), 3)
    ) / 2
    privacy = privacy_settings({**FIXED, "target_epsilon": target})
    strategy = wrap_strategy(FedAvg(), privacy, N)
    guard = PrivacyGuard(privacy, strategy)
    for server_round in (1, 2):
        guard.before_round(server_round)
        aggregate_round(strategy, server_round, [np.ones(8)] * N)
    spent = guard.epsilon()
    with pytest.raises(PrivacyBudgetExhausted) as info:
        guard.before_round(3)
    assert info.value.server_round == 3 and info.value.epsilon == spent
    assert spent is not None and spent <= target < info.value.next_epsilon
    assert "privacy.target_epsilon" in str(info.value)
    assert guard.epsilon() == spent  # the check spends nothing


def test_local_guard_charges_every_round_it_lets_start() -> None:
    target = epsilon_after(privacy_settings(LOCAL), 3)
    guard = PrivacyGuard(privacy_settings({**LOCAL, "target_epsilon": target}), FedAvg())
    for server_round in (1, 2, 3):
        guard.before_round(server_round)
    assert guard.epsilon() == target
    with pytest.raises(PrivacyBudgetExhausted):
        guard.before_round(4)
    assert PrivacyGuard(privacy_settings({"name": "none"}), FedAvg()).epsilon() is None


def test_guard_needs_a_wrapped_strategy_in_central_modes() -> None:
    with pytest.raises(ValueError, match="wrap_strategy"):
        PrivacyGuard(privacy_settings(FIXED), FedAvg())
