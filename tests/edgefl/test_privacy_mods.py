"""Client-side DP mods with real messages: clipping, local noise, and the keys replies carry."""

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import (
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
from flwr.serverapp.strategy import FedAvg
from privacy_messages import (
    ADAPTIVE,
    FIXED,
    LOCAL,
    N,
    array_record,
    config_of,
    configure_train,
    metrics_of,
    weights_of,
)

from edgefl.client_app import build_client_app
from edgefl.data import load_dataset
from edgefl.models import build_model
from edgefl.privacy import (
    UNIT_WEIGHT_KEY,
    client_evaluate_mods,
    client_train_mods,
    evaluate_metric_keys,
    evaluate_privacy_mod,
    local_noise_stdev,
    privacy_settings,
    train_config_keys,
    train_metric_keys,
    train_privacy_mod,
    wrap_strategy,
)
from edgefl.records import EVAL_METRIC_KEYS, TRAIN_METRIC_KEYS
from edgefl.settings import RunSettings


def _client(mods: list[Mod], update: np.ndarray) -> Callable[[Message], Message]:
    """A train handler that adds ``update`` to the received arrays, behind ``mods``."""

    def handler(msg: Message, context: Context) -> Message:
        arrays = array_record(weights_of(msg) + update)
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
        sent = configure_train(wrap_strategy(FedAvg(), privacy, N), 1, size=100)
        config = config_of(sent[0])
        assert set(config) - {"lr", "server-round"} == train_config_keys(privacy)
        reply = _client(client_train_mods(privacy), np.full(100, 1.0))(sent[0])
        assert not reply.has_error()
        assert np.linalg.norm(weights_of(reply)) == pytest.approx(1.0)
        assert tuple(metrics_of(reply))[1:] == train_metric_keys(privacy)


def test_local_dp_mod_clips_and_noises_a_client_update() -> None:
    np.random.seed(4)
    privacy = privacy_settings(LOCAL)
    size = 40_000
    msg = Message(
        RecordDict({"arrays": array_record(np.zeros(size)), "config": ConfigRecord({"lr": 0.1})}),
        dst_node_id=1,
        message_type=MessageType.TRAIN,
    )
    update = np.full(size, 10 / math.sqrt(size))  # norm 10, clipped to 1
    sent = weights_of(_client(client_train_mods(privacy), update)(msg))
    noise = sent - 1 / math.sqrt(size)
    assert abs(noise.mean()) < 4 * local_noise_stdev(privacy) / math.sqrt(size)
    assert noise.std() == pytest.approx(local_noise_stdev(privacy), rel=0.03)
    assert client_evaluate_mods(privacy) == []


def test_evaluate_replies_carry_the_unit_weight_in_central_modes() -> None:
    mods = client_evaluate_mods(privacy_settings(FIXED))
    msg = Message(
        RecordDict({"arrays": array_record(np.zeros(4))}),
        dst_node_id=1,
        message_type=MessageType.EVALUATE,
    )
    reply = _client(mods, np.zeros(4))(msg)
    assert metrics_of(reply)[UNIT_WEIGHT_KEY] == 1


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
    assert tuple(metrics_of(private)) == TRAIN_METRIC_KEYS
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
    assert set(metrics_of(reply)) == set(TRAIN_METRIC_KEYS) | set(train_metric_keys(privacy))
    evaluate_msg = Message(
        RecordDict({"arrays": msg.content.array_records["arrays"], "config": ConfigRecord()}),
        dst_node_id=7,
        message_type=MessageType.EVALUATE,
    )
    evaluated = app(evaluate_msg, context)
    assert not evaluated.has_error(), evaluated.error.reason if evaluated.has_error() else ""
    assert set(metrics_of(evaluated)) == set(EVAL_METRIC_KEYS) | set(evaluate_metric_keys(privacy))
