"""Central DP: Flower's server-side wrappers with real messages: clipping, calibrated noise."""

import math
import pickle

import numpy as np
import pytest
from flwr.serverapp.strategy import FedAdam, FedAvg, FedMedian, FedProx, Strategy
from privacy_messages import (
    ADAPTIVE,
    FIXED,
    LOCAL,
    N,
    aggregate_round,
    config_of,
    configure_train,
    train_replies,
)

from edgefl.errors import ConfigError
from edgefl.privacy import (
    CLIPPING_NORM_KEY,
    NORM_BIT_KEY,
    AdaptiveClipping,
    PrivacyGuard,
    epsilon_after,
    privacy_settings,
    wrap_strategy,
)
from edgefl.privacy.accounting import update_noise_multiplier


@pytest.mark.parametrize("strategy", [FedMedian(), FedAdam()], ids=["fedmedian", "fedadam"])
def test_central_dp_refuses_strategies_that_do_not_average(strategy: Strategy) -> None:
    with pytest.raises(ConfigError, match="strategy=fedavg"):
        wrap_strategy(strategy, privacy_settings(FIXED), N)
    assert wrap_strategy(strategy, privacy_settings(LOCAL), N) is strategy


def test_central_noise_has_the_calibrated_stdev_around_the_clipped_mean() -> None:
    """Server-side clipping to norm C, unweighted mean, then N(0, (z C / n)^2) per coordinate."""
    np.random.seed(0)
    privacy = privacy_settings({**FIXED, "noise_multiplier": 2.0, "clipping_norm": 0.5})
    strategy = wrap_strategy(FedProx(), privacy, N)
    size = 40_000
    updates = [np.full(size, (i + 1) / math.sqrt(size)) for i in range(N)]  # norms 1, 2, 3, 4
    noisy = aggregate_round(strategy, 1, updates)
    clipped_mean = 0.5 / math.sqrt(size)  # all clipped to 0.5; unweighted despite num-examples
    noise = noisy - clipped_mean
    assert abs(noise.mean()) < 4 * 0.25 / math.sqrt(size)
    assert noise.std() == pytest.approx(2.0 * 0.5 / N, rel=0.03)


def test_central_noise_changes_the_aggregate_of_identical_rounds() -> None:
    np.random.seed(1)
    strategy = wrap_strategy(FedAvg(), privacy_settings({**FIXED, "clipping_side": "client"}), N)
    updates = [np.full(1000, 0.01)] * N
    first, second = aggregate_round(strategy, 1, updates), aggregate_round(strategy, 2, updates)
    assert not np.allclose(first, second)
    assert np.abs(first - second).std() > 0.1


def test_adaptive_norm_grows_when_updates_are_clipped_and_shrinks_when_not() -> None:
    np.random.seed(2)
    privacy = privacy_settings({**ADAPTIVE, "clipping_side": "server", "clipped_count_stddev": 4})
    strategy = wrap_strategy(FedAvg(), privacy, N)
    assert isinstance(strategy, AdaptiveClipping)
    norms = [strategy.clipping_norm]
    for server_round in range(1, 4):  # update norm 100 >> C: all clipped
        aggregate_round(strategy, server_round, [np.full(100, 10.0)] * N)
        norms.append(strategy.clipping_norm)
    for server_round in range(4, 7):  # update norm 0.01: none clipped
        aggregate_round(strategy, server_round, [np.full(100, 0.001)] * N)
        norms.append(strategy.clipping_norm)
    assert norms[3] > norms[0] and norms[6] < norms[3]


def test_adaptive_noise_is_scaled_by_the_norm_the_updates_were_clipped_to() -> None:
    np.random.seed(3)
    privacy = privacy_settings(ADAPTIVE)  # client side: the clients clip, replies carry bits
    strategy = wrap_strategy(FedAvg(), privacy, N)
    assert isinstance(strategy, AdaptiveClipping)
    norm_before = strategy.clipping_norm
    sent = configure_train(strategy, 1, 40_000)
    assert {config_of(m)[CLIPPING_NORM_KEY] for m in sent} == {norm_before}
    replies = train_replies(sent, [np.zeros(40_000)] * N, extra={NORM_BIT_KEY: 1})
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None and strategy.clipping_norm != norm_before
    z_update = update_noise_multiplier(1.0, 2.0)
    assert arrays["w"].numpy().std() == pytest.approx(z_update * norm_before / N, rel=0.03)


def test_adaptive_round_costs_exactly_the_configured_noise_multiplier() -> None:
    privacy = privacy_settings(ADAPTIVE)
    strategy = wrap_strategy(FedAvg(), privacy, N)
    sent = configure_train(strategy, 1)
    strategy.aggregate_train(1, train_replies(sent, [np.zeros(8)] * N, extra={NORM_BIT_KEY: 0}))
    guard = PrivacyGuard(privacy, strategy)
    assert guard.epsilon() == pytest.approx(epsilon_after(privacy, 1), rel=1e-9)


def test_adaptive_reply_without_norm_bit_is_refused_before_any_release() -> None:
    strategy = wrap_strategy(FedAvg(), privacy_settings(ADAPTIVE), N)
    with pytest.raises(ValueError, match="adaptiveclipping_mod"):
        strategy.aggregate_train(1, train_replies(configure_train(strategy, 1), [np.zeros(8)] * N))
    assert PrivacyGuard(privacy_settings(ADAPTIVE), strategy).epsilon() == 0.0


def test_a_round_with_too_few_replies_releases_nothing() -> None:
    privacy = privacy_settings(FIXED)
    strategy = wrap_strategy(FedAvg(), privacy, N)
    sent = configure_train(strategy, 1)
    arrays, _ = strategy.aggregate_train(1, train_replies(sent[:-1], [np.zeros(8)] * (N - 1)))
    assert arrays is None
    assert PrivacyGuard(privacy, strategy).epsilon() == 0.0


def test_wrapped_strategy_pickles_with_its_spent_budget() -> None:
    """A checkpoint pickles the strategy; the restored one continues the same ledger."""
    for raw in (FIXED, {**ADAPTIVE, "clipping_side": "server"}):
        privacy = privacy_settings(raw)
        strategy = wrap_strategy(FedAvg(), privacy, N)
        aggregate_round(strategy, 1, [np.ones(8)] * N)
        restored = pickle.loads(pickle.dumps(strategy))
        spent = PrivacyGuard(privacy, strategy).epsilon()
        assert spent is not None and spent > 0
        assert PrivacyGuard(privacy, restored).epsilon() == spent
