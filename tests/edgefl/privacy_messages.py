"""Raw privacy settings and hand-built Flower train messages shared by the privacy tests."""

from collections.abc import Sequence
from typing import cast

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from edgefl.privacy import UNIT_WEIGHT_KEY

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


class NodeIdsGrid:
    """The one Grid call FedAvg's configure_train makes: the connected node ids."""

    def get_node_ids(self) -> list[int]:
        return list(range(1, N + 1))


def array_record(values: np.ndarray) -> ArrayRecord:
    return ArrayRecord({"w": Array(values.astype(np.float32))})


def configure_train(strategy: Strategy, server_round: int, size: int = 8) -> list[Message]:
    config = ConfigRecord({"lr": 0.1})
    grid = cast(Grid, NodeIdsGrid())  # FedAvg's configure_train only lists the node ids
    return list(strategy.configure_train(server_round, array_record(np.zeros(size)), config, grid))


def train_replies(
    sent: Sequence[Message], updates: Sequence[np.ndarray], extra: dict[str, int] | None = None
) -> list[Message]:
    """Train replies the way a client sends them: arrays (global zeros + update) and metrics."""
    return [
        Message(
            RecordDict(
                {
                    "arrays": array_record(update),
                    "metrics": MetricRecord(
                        {"num-examples": 10 * (i + 1), UNIT_WEIGHT_KEY: 1, **(extra or {})}
                    ),
                }
            ),
            reply_to=msg,
        )
        for i, (msg, update) in enumerate(zip(sent, updates, strict=True))
    ]


def aggregate_round(
    strategy: Strategy, server_round: int, updates: Sequence[np.ndarray]
) -> np.ndarray:
    sent = configure_train(strategy, server_round, updates[0].size)
    arrays, _ = strategy.aggregate_train(server_round, train_replies(sent, updates))
    assert arrays is not None
    return np.asarray(arrays["w"].numpy(), dtype=np.float64)


def weights_of(msg: Message) -> np.ndarray:
    return np.asarray(msg.content.array_records["arrays"]["w"].numpy(), dtype=np.float64)


def metrics_of(msg: Message) -> MetricRecord:
    return msg.content.metric_records["metrics"]


def config_of(msg: Message) -> ConfigRecord:
    return msg.content.config_records["config"]
