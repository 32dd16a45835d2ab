"""Pacing math and the MemoryAware wrapper: caps for slow clients, smaller batches on failure."""

import logging
from typing import cast

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from strategies.memory_aware import MemoryAware
from strategies.pacing import NodeSpeed, example_cap, round_deadline_s
from strategies.replies import ERROR_CODE_BUDGET
from tests.strategies.nodes import Nodes


def test_deadline_is_the_nearest_rank_quantile() -> None:
    times = [4.0, 1.0, 3.0, 2.0]
    assert round_deadline_s(times, 0.5) == 2.0
    assert round_deadline_s(times, 1.0) == 4.0
    assert round_deadline_s(times, 0.01) == 1.0
    with pytest.raises(ValueError, match="quantile=0"):
        round_deadline_s(times, 0.0)


def test_cap_fits_the_deadline_in_whole_batches_and_keeps_a_floor() -> None:
    slow = NodeSpeed(seconds_per_example=0.01, full_examples=1000, batch_size=32)  # 10 s
    assert example_cap(slow, 10.0, 0.25) == 0  # on time: no cap
    assert example_cap(slow, 5.0, 0.25) == 480  # 500 affordable -> 15 batches of 32
    assert example_cap(slow, 1.0, 0.25) == 250  # 100 affordable, but at least a quarter


def _train_reply(instruction: Message, train_s: float, processed: int) -> Message:
    metrics = MetricRecord({"num-examples": processed, "examples-processed": processed})
    metrics["train-s"] = train_s
    arrays = ArrayRecord({"w": Array(np.ones(2, dtype=np.float32))})
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=instruction)


def _round(strategy: MemoryAware, grid: Nodes, server_round: int) -> list[Message]:
    arrays = ArrayRecord({"w": Array(np.zeros(2, dtype=np.float32))})
    config = ConfigRecord({"lr": 0.1, "batch-size": 32})
    return list(strategy.configure_train(server_round, arrays, config, cast(Grid, grid)))


def _configs(messages: list[Message]) -> dict[int, ConfigRecord]:
    return {m.metadata.dst_node_id: m.content["config"] for m in messages}


def test_slow_client_is_capped_from_round_two_and_others_are_not() -> None:
    grid = Nodes([1, 2, 3])
    strategy = MemoryAware(FedAvg(min_available_nodes=3), deadline_quantile=0.5)
    first = _round(strategy, grid, 1)
    assert all("max-examples" not in c for c in _configs(first).values())  # nothing known yet
    seconds = {1: 2.0, 2: 2.5, 3: 8.0}  # node 3 is the memory-starved one: 4x slower
    replies = [_train_reply(m, seconds[m.metadata.dst_node_id], 400) for m in first]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None

    configs = _configs(_round(strategy, grid, 2))
    assert configs[1]["max-examples"] == 0 and configs[2]["max-examples"] == 0
    assert 100 <= cast(int, configs[3]["max-examples"]) <= 2.5 / 8.0 * 400  # fits the median
    assert all(c["lr"] == 0.1 and c["server-round"] == 2 for c in configs.values())


def test_budget_failure_halves_that_clients_batch() -> None:
    grid = Nodes([1, 2])
    strategy = MemoryAware(FedAvg(), min_batch_size=8)
    first = _round(strategy, grid, 1)
    failed = Message(Error(code=ERROR_CODE_BUDGET, reason="budget"), reply_to=first[1])
    strategy.aggregate_train(1, [_train_reply(first[0], 1.0, 100), failed])
    configs = _configs(_round(strategy, grid, 2))
    assert configs[first[0].metadata.dst_node_id]["batch-size"] == 32
    assert configs[first[1].metadata.dst_node_id]["batch-size"] == 16
    for _ in range(3):  # keeps failing: the batch stops at the floor
        msgs = _round(strategy, grid, 3)
        node2 = next(m for m in msgs if m.metadata.dst_node_id == first[1].metadata.dst_node_id)
        strategy.aggregate_train(
            3, [Message(Error(code=ERROR_CODE_BUDGET, reason="budget"), reply_to=node2)]
        )
    assert _configs(_round(strategy, grid, 4))[first[1].metadata.dst_node_id]["batch-size"] == 8


def test_weights_are_the_examples_each_client_trained() -> None:
    grid = Nodes([1, 2])
    strategy = MemoryAware(FedAvg())
    msgs = _round(strategy, grid, 1)
    replies = []
    for m, value, processed in zip(msgs, (1.0, 4.0), (300, 100), strict=True):
        reply = _train_reply(m, 1.0, processed)
        reply.content["arrays"] = ArrayRecord({"w": Array(np.full(2, value, dtype=np.float32))})
        replies.append(reply)
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None
    assert np.allclose(arrays["w"].numpy(), (300 * 1.0 + 100 * 4.0) / 400)


def test_each_capped_client_gets_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    grid = Nodes([1, 2, 3])
    strategy = MemoryAware(FedAvg(min_available_nodes=3), deadline_quantile=0.5)
    first = _round(strategy, grid, 1)
    seconds = {1: 2.0, 2: 2.5, 3: 8.0}
    strategy.aggregate_train(
        1, [_train_reply(m, seconds[m.metadata.dst_node_id], 400) for m in first]
    )
    own = logging.getLogger("strategies")
    if not own.propagate:  # edgefl's configure_logging gives it its own handler
        own.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="strategies.memory_aware"):
            _round(strategy, grid, 2)
    finally:
        own.removeHandler(caplog.handler)
    capped = [r.getMessage() for r in caplog.records if "capped" in r.getMessage()]
    assert len(capped) == 1 and "round 2: node 3 capped at" in capped[0]
    assert "of 400 examples" in capped[0]
