"""Differential privacy: settings, Flower's DP wrappers and mods with real messages, accounting."""

import itertools
import math
import pickle
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import Mod
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAdam, FedAvg, FedMedian, FedProx, Strategy
from omegaconf import OmegaConf

from edgefl.client_app import build_client_app
from edgefl.config import compose_config, group_options
from edgefl.data import load_dataset
from edgefl.errors import ConfigError
from edgefl.models import build_model
from edgefl.privacy import (
    CLIPPING_NORM_KEY,
    NORM_BIT_KEY,
    UNIT_WEIGHT_KEY,
    AdaptiveClipping,
    PrivacyBudgetExhausted,
    PrivacyGuard,
    PrivacyMode,
    PrivacySettings,
    check_secure_aggregation,
    client_evaluate_mods,
    client_train_mods,
    epsilon_after,
    evaluate_metric_keys,
    evaluate_privacy_mod,
    local_noise_stdev,
    privacy_settings,
    train_config_keys,
    train_metric_keys,
    train_privacy_mod,
    wrap_strategy,
)
from edgefl.privacy.accounting import update_noise_multiplier
from edgefl.records import EVAL_METRIC_KEYS, TRAIN_METRIC_KEYS
from edgefl.settings import RunSettings

N = 4  # clients per round
FIXED = {
    "name": "central-fixed",
    "clipping_side": "server",
    "noise_multiplier": 1.0,
    "clipping_norm": 1.0,
    "delta": 1e-5,
    "target_epsilon": None,
}
ADAPTIVE = {
    **FIXED,
    "name": "central-adaptive",
    "clipping_side": "client",
    "target_clipped_quantile": 0.5,
    "clip_norm_lr": 0.2,
    "clipped_count_stddev": 2.0,
}
LOCAL = {
    "name": "local",
    "clipping_norm": 1.0,
    "local_epsilon": 10.0,
    "local_sensitivity": 2.0,
    "delta": 1e-5,
    "target_epsilon": None,
}


class _Grid:
    """The one Grid call FedAvg's configure_train makes: the connected node ids."""

    def get_node_ids(self) -> list[int]:
        return list(range(1, N + 1))


def _arrays(values: np.ndarray) -> ArrayRecord:
    return ArrayRecord({"w": Array(values.astype(np.float32))})


def _configure(strategy: Strategy, server_round: int, size: int = 8) -> list[Message]:
    config = ConfigRecord({"lr": 0.1})
    grid = cast(Grid, _Grid())  # FedAvg's configure_train only lists the node ids
    return list(strategy.configure_train(server_round, _arrays(np.zeros(size)), config, grid))


def _replies(
    sent: Sequence[Message], updates: Sequence[np.ndarray], extra: dict[str, int] | None = None
) -> list[Message]:
    """Train replies the way a client sends them: arrays (global zeros + update) and metrics."""
    return [
        Message(
            RecordDict(
                {
                    "arrays": _arrays(update),
                    "metrics": MetricRecord(
                        {"num-examples": 10 * (i + 1), UNIT_WEIGHT_KEY: 1, **(extra or {})}
                    ),
                }
            ),
            reply_to=msg,
        )
        for i, (msg, update) in enumerate(zip(sent, updates, strict=True))
    ]


def _round(strategy: Strategy, server_round: int, updates: Sequence[np.ndarray]) -> np.ndarray:
    sent = _configure(strategy, server_round, updates[0].size)
    arrays, _ = strategy.aggregate_train(server_round, _replies(sent, updates))
    assert arrays is not None
    return np.asarray(arrays["w"].numpy(), dtype=np.float64)


def _weights(msg: Message) -> np.ndarray:
    return np.asarray(msg.content.array_records["arrays"]["w"].numpy(), dtype=np.float64)


def _metrics(msg: Message) -> MetricRecord:
    return msg.content.metric_records["metrics"]


def _config(msg: Message) -> ConfigRecord:
    return msg.content.config_records["config"]


# -- settings --------------------------------------------------------------------------------


@pytest.mark.parametrize("option", group_options("privacy"))
def test_privacy_settings_every_option_converts(option: str) -> None:
    raw = OmegaConf.to_container(compose_config([f"privacy={option}"]).privacy, resolve=True)
    assert isinstance(raw, dict)
    settings = privacy_settings(cast(dict[str, Any], raw))
    assert settings.mode is PrivacyMode(option.replace("_", "-"))
    assert settings.delta == 1e-5


@pytest.mark.parametrize(
    "raw, words",
    [
        ({**FIXED, "name": "central"}, ["privacy.name='central'", "central-fixed"]),
        ({**FIXED, "local_epsilon": 3.0}, ["privacy.local_epsilon=3.0", "remove it"]),
        ({k: v for k, v in FIXED.items() if k != "clipping_norm"}, ["privacy.clipping_norm"]),
        ({**FIXED, "noise_multiplier": -1.0}, ["privacy.noise_multiplier=-1.0", "greater than 0"]),
        ({**FIXED, "noise_multiplier": True}, ["privacy.noise_multiplier=True", "number"]),
        ({**FIXED, "delta": 1.5}, ["privacy.delta=1.5", "between 0 and 1"]),
        ({**FIXED, "clipping_side": "both"}, ["privacy.clipping_side='both'", "'client'"]),
        ({**FIXED, "target_epsilon": 0}, ["privacy.target_epsilon=0", "greater than 0"]),
        ({**ADAPTIVE, "clipped_count_stddev": 0.5}, ["clipped_count_stddev=0.5", "raise"]),
        ({**LOCAL, "local_epsilon": "ten"}, ["privacy.local_epsilon='ten'", "number"]),
    ],
)
def test_privacy_settings_reject_bad_values(raw: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        privacy_settings(raw)
    assert all(word in str(info.value) for word in words), str(info.value)


def test_privacy_settings_keep_the_values() -> None:
    settings = privacy_settings({**ADAPTIVE, "target_epsilon": 8})
    assert settings.mode is PrivacyMode.CENTRAL_ADAPTIVE and settings.central
    assert (settings.noise_multiplier, settings.clipped_count_stddev) == (1.0, 2.0)
    assert settings.target_epsilon == 8.0
    assert privacy_settings({"name": "none"}) == PrivacySettings()


def test_secure_aggregation_needs_client_side_clipping() -> None:
    with pytest.raises(ConfigError, match="clipping_side=client"):
        check_secure_aggregation(privacy_settings(FIXED))
    for raw in ({**FIXED, "clipping_side": "client"}, ADAPTIVE, LOCAL, {"name": "none"}):
        check_secure_aggregation(privacy_settings(raw))


# -- server-side wrappers ------------------------------------------------------------------


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
    noisy = _round(strategy, 1, updates)
    clipped_mean = 0.5 / math.sqrt(size)  # all clipped to 0.5; unweighted despite num-examples
    noise = noisy - clipped_mean
    assert abs(noise.mean()) < 4 * 0.25 / math.sqrt(size)
    assert noise.std() == pytest.approx(2.0 * 0.5 / N, rel=0.03)


def test_central_noise_changes_the_aggregate_of_identical_rounds() -> None:
    np.random.seed(1)
    strategy = wrap_strategy(FedAvg(), privacy_settings({**FIXED, "clipping_side": "client"}), N)
    updates = [np.full(1000, 0.01)] * N
    first, second = _round(strategy, 1, updates), _round(strategy, 2, updates)
    assert not np.allclose(first, second)
    assert np.abs(first - second).std() > 0.1


def test_adaptive_norm_grows_when_updates_are_clipped_and_shrinks_when_not() -> None:
    np.random.seed(2)
    privacy = privacy_settings({**ADAPTIVE, "clipping_side": "server", "clipped_count_stddev": 4})
    strategy = wrap_strategy(FedAvg(), privacy, N)
    assert isinstance(strategy, AdaptiveClipping)
    norms = [strategy.clipping_norm]
    for server_round in range(1, 4):  # update norm 100 >> C: all clipped
        _round(strategy, server_round, [np.full(100, 10.0)] * N)
        norms.append(strategy.clipping_norm)
    for server_round in range(4, 7):  # update norm 0.01: none clipped
        _round(strategy, server_round, [np.full(100, 0.001)] * N)
        norms.append(strategy.clipping_norm)
    assert norms[3] > norms[0] and norms[6] < norms[3]


def test_adaptive_noise_is_scaled_by_the_norm_the_updates_were_clipped_to() -> None:
    np.random.seed(3)
    privacy = privacy_settings(ADAPTIVE)  # client side: the clients clip, replies carry bits
    strategy = wrap_strategy(FedAvg(), privacy, N)
    assert isinstance(strategy, AdaptiveClipping)
    norm_before = strategy.clipping_norm
    sent = _configure(strategy, 1, 40_000)
    assert {_config(m)[CLIPPING_NORM_KEY] for m in sent} == {norm_before}
    replies = _replies(sent, [np.zeros(40_000)] * N, extra={NORM_BIT_KEY: 1})
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None and strategy.clipping_norm != norm_before
    z_update = update_noise_multiplier(1.0, 2.0)
    assert arrays["w"].numpy().std() == pytest.approx(z_update * norm_before / N, rel=0.03)


def test_adaptive_round_costs_exactly_the_configured_noise_multiplier() -> None:
    privacy = privacy_settings(ADAPTIVE)
    strategy = wrap_strategy(FedAvg(), privacy, N)
    sent = _configure(strategy, 1)
    strategy.aggregate_train(1, _replies(sent, [np.zeros(8)] * N, extra={NORM_BIT_KEY: 0}))
    guard = PrivacyGuard(privacy, strategy)
    assert guard.epsilon() == pytest.approx(epsilon_after(privacy, 1), rel=1e-9)


def test_adaptive_reply_without_norm_bit_is_refused_before_any_release() -> None:
    strategy = wrap_strategy(FedAvg(), privacy_settings(ADAPTIVE), N)
    with pytest.raises(ValueError, match="adaptiveclipping_mod"):
        strategy.aggregate_train(1, _replies(_configure(strategy, 1), [np.zeros(8)] * N))
    assert PrivacyGuard(privacy_settings(ADAPTIVE), strategy).epsilon() == 0.0


def test_a_round_with_too_few_replies_releases_nothing() -> None:
    privacy = privacy_settings(FIXED)
    strategy = wrap_strategy(FedAvg(), privacy, N)
    sent = _configure(strategy, 1)
    arrays, _ = strategy.aggregate_train(1, _replies(sent[:-1], [np.zeros(8)] * (N - 1)))
    assert arrays is None
    assert PrivacyGuard(privacy, strategy).epsilon() == 0.0


def test_wrapped_strategy_pickles_with_its_spent_budget() -> None:
    """A checkpoint pickles the strategy; the restored one continues the same ledger."""
    for raw in (FIXED, {**ADAPTIVE, "clipping_side": "server"}):
        privacy = privacy_settings(raw)
        strategy = wrap_strategy(FedAvg(), privacy, N)
        _round(strategy, 1, [np.ones(8)] * N)
        restored = pickle.loads(pickle.dumps(strategy))
        spent = PrivacyGuard(privacy, strategy).epsilon()
        assert spent is not None and spent > 0
        assert PrivacyGuard(privacy, restored).epsilon() == spent


# -- accounting and the guard ------------------------------------------------------------------


@pytest.mark.parametrize("raw", [FIXED, ADAPTIVE, LOCAL], ids=["fixed", "adaptive", "local"])
def test_epsilon_grows_every_round(raw: dict[str, Any]) -> None:
    privacy = privacy_settings(raw)
    strategy = wrap_strategy(FedAvg(), privacy, N)
    guard = PrivacyGuard(privacy, strategy)
    spent = [guard.epsilon()]
    for server_round in range(1, 5):
        guard.before_round(server_round)
        if privacy.central:
            sent = _configure(strategy, server_round)
            strategy.aggregate_train(
                server_round, _replies(sent, [np.ones(8)] * N, extra={NORM_BIT_KEY: 1})
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
        _round(strategy, server_round, [np.ones(8)] * N)
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


# -- client-side mods --------------------------------------------------------------------------


def _client(mods: list[Mod], update: np.ndarray) -> Callable[[Message], Message]:
    """A train handler that adds ``update`` to the received arrays, behind ``mods``."""

    def handler(msg: Message, context: Context) -> Message:
        arrays = _arrays(_weights(msg) + update)
        return Message(
            RecordDict({"arrays": arrays, "metrics": MetricRecord({"n": 1})}), reply_to=msg
        )

    call: Callable[[Message, Context], Message] = handler
    for mod in reversed(mods):
        call = _behind(mod, call)
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    return lambda msg: call(msg, context)


def _behind(mod: Mod, call_next: Callable[[Message, Context], Message]) -> Any:
    return lambda msg, context: mod(msg, context, call_next)


def test_client_side_clipping_with_the_wrappers_config() -> None:
    """The keys the wrappers send and the mods add are the ones the package declares."""
    for raw in ({**FIXED, "clipping_side": "client"}, ADAPTIVE):
        privacy = privacy_settings(raw)
        sent = _configure(wrap_strategy(FedAvg(), privacy, N), 1, size=100)
        config = _config(sent[0])
        assert set(config) - {"lr", "server-round"} == train_config_keys(privacy)
        reply = _client(client_train_mods(privacy), np.full(100, 1.0))(sent[0])
        assert not reply.has_error()
        assert np.linalg.norm(_weights(reply)) == pytest.approx(1.0)
        assert tuple(_metrics(reply))[1:] == train_metric_keys(privacy)


def test_local_dp_mod_clips_and_noises_a_client_update() -> None:
    np.random.seed(4)
    privacy = privacy_settings(LOCAL)
    size = 40_000
    msg = Message(
        RecordDict({"arrays": _arrays(np.zeros(size)), "config": ConfigRecord({"lr": 0.1})}),
        dst_node_id=1,
        message_type=MessageType.TRAIN,
    )
    update = np.full(size, 10 / math.sqrt(size))  # norm 10, clipped to 1
    sent = _weights(_client(client_train_mods(privacy), update)(msg))
    noise = sent - 1 / math.sqrt(size)
    assert abs(noise.mean()) < 4 * local_noise_stdev(privacy) / math.sqrt(size)
    assert noise.std() == pytest.approx(local_noise_stdev(privacy), rel=0.03)
    assert client_evaluate_mods(privacy) == []


def test_evaluate_replies_carry_the_unit_weight_in_central_modes() -> None:
    mods = client_evaluate_mods(privacy_settings(FIXED))
    msg = Message(
        RecordDict({"arrays": _arrays(np.zeros(4))}),
        dst_node_id=1,
        message_type=MessageType.EVALUATE,
    )
    reply = _client(mods, np.zeros(4))(msg)
    assert _metrics(reply)[UNIT_WEIGHT_KEY] == 1


def _train_message(settings: RunSettings, extra_config: dict[str, float]) -> Message:
    info = load_dataset(settings.client.data.name).info
    torch.manual_seed(0)
    model = build_model(settings.client.model.name, info, settings.client.model.options)
    config = ConfigRecord({"server-round": 1, "lr": 0.05, **extra_config})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "config": config})
    return Message(content, dst_node_id=7, message_type=MessageType.TRAIN)


@pytest.mark.slow
def test_local_dp_on_the_real_client_noises_its_trained_update(
    smoke_settings: RunSettings,
) -> None:
    """Training is deterministic per round, so the mod's output minus plain training is noise."""
    np.random.seed(5)
    privacy = privacy_settings({**LOCAL, "clipping_norm": 1e3, "local_sensitivity": 2e3})
    app = build_client_app(smoke_settings.client)
    context = Context(
        run_id=1,
        node_id=7,
        node_config={"partition-id": 0, "num-partitions": 2},
        state=RecordDict(),
        run_config={},
    )
    msg = _train_message(smoke_settings, {})
    plain = app(msg, context)
    private = client_train_mods(privacy)[0](msg, context, app)
    assert tuple(_metrics(private)) == TRAIN_METRIC_KEYS
    noise = np.concatenate(
        [
            (private.content.array_records["arrays"][k].numpy() - a.numpy()).ravel()
            for k, a in plain.content.array_records["arrays"].items()
        ]
    )
    assert noise.size > 5000
    assert noise.std() == pytest.approx(local_noise_stdev(privacy), rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize(
    "raw", [{**FIXED, "clipping_side": "client"}, ADAPTIVE, FIXED, LOCAL, {"name": "none"}]
)
def test_real_client_behind_per_handler_mods_replies_with_the_declared_keys(
    smoke_settings: RunSettings, raw: dict[str, Any]
) -> None:
    """edgefl's handlers behind the mods, attached per handler as client_app.py attaches them."""
    privacy = privacy_settings(raw)
    edgefl_app = build_client_app(smoke_settings.client)
    app = ClientApp()

    @app.train(mods=[train_privacy_mod(lambda _: privacy)])
    def train(msg: Message, context: Context) -> Message:
        return edgefl_app(msg, context)

    @app.evaluate(mods=[evaluate_privacy_mod(lambda _: privacy)])
    def evaluate(msg: Message, context: Context) -> Message:
        return edgefl_app(msg, context)

    context = Context(
        run_id=1,
        node_id=7,
        node_config={"partition-id": 0, "num-partitions": 2},
        state=RecordDict(),
        run_config={},
    )
    msg = _train_message(smoke_settings, {k: 0.5 for k in train_config_keys(privacy)})
    reply = app(msg, context)
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    assert set(_metrics(reply)) == set(TRAIN_METRIC_KEYS) | set(train_metric_keys(privacy))
    evaluate_msg = Message(
        RecordDict({"arrays": msg.content.array_records["arrays"], "config": ConfigRecord()}),
        dst_node_id=7,
        message_type=MessageType.EVALUATE,
    )
    evaluated = app(evaluate_msg, context)
    assert not evaluated.has_error(), evaluated.error.reason if evaluated.has_error() else ""
    assert set(_metrics(evaluated)) == set(EVAL_METRIC_KEYS) | set(evaluate_metric_keys(privacy))
