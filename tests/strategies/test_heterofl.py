"""HeteroFL's math (slices, overlap averages) and the strategy on replies built as Flower's."""

from typing import Any, cast

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from strategies.heterofl import (
    WIDTH_RATIO,
    WIDTH_RATIOS,
    HeteroFL,
    aggregate_overlapping,
    check_ratios,
    scaled_width,
    slice_to_shapes,
)
from strategies.replies import ERROR_CODE_BUDGET
from tests.strategies.nodes import Nodes


def _global() -> dict[str, np.ndarray]:
    return {
        "w": np.arange(12, dtype=np.float32).reshape(4, 3),
        "b": np.arange(4, dtype=np.float32),
    }


def test_scaled_width_is_ceil_of_ratio_times_channels() -> None:
    assert [scaled_width(8, r) for r in (1.0, 0.5, 0.25, 0.125, 0.1)] == [8, 4, 2, 1, 1]
    assert scaled_width(30, 0.1) == 3  # 0.1 * 30 is 3.0000000000000004 in floats
    assert scaled_width(10, 0.25) == 3
    with pytest.raises(ValueError, match=r"width ratio 1\.5 is outside"):
        scaled_width(8, 1.5)


def test_ratios_are_checked_and_sorted_widest_first() -> None:
    assert check_ratios([0.25, 1.0, 0.5, 1.0]) == (1.0, 0.5, 0.25)
    with pytest.raises(ValueError, match="empty"):
        check_ratios([])
    with pytest.raises(ValueError, match=r"width ratio 0\.0 is outside"):
        check_ratios([1.0, 0.0])


def test_slice_takes_the_leading_block_of_each_array() -> None:
    sub = slice_to_shapes(_global(), {"w": (2, 3), "b": (2,)})
    np.testing.assert_array_equal(sub["w"], [[0, 1, 2], [3, 4, 5]])
    np.testing.assert_array_equal(sub["b"], [0, 1])
    assert sub["w"].flags.c_contiguous


def test_slice_refuses_shapes_that_are_no_slice() -> None:
    with pytest.raises(
        ValueError, match=r"'w' of shape \(5, 3\) is no leading slice of .*\(4, 3\)"
    ):
        slice_to_shapes(_global(), {"w": (5, 3), "b": (2,)})
    with pytest.raises(ValueError, match="rank"):
        slice_to_shapes(_global(), {"w": (4,), "b": (2,)})
    with pytest.raises(ValueError, match="keys"):
        slice_to_shapes(_global(), {"w": (4, 3)})


def test_overlap_average_weighs_each_element_by_the_clients_covering_it() -> None:
    g = _global()
    full = {"w": np.full((4, 3), 10.0, np.float32), "b": np.full(4, 10.0, np.float32)}
    half = {"w": np.full((2, 3), 1.0, np.float32), "b": np.full(2, 1.0, np.float32)}
    merged = aggregate_overlapping(g, [(full, 1.0), (half, 3.0)])
    # rows 0-1: both clients, (1*10 + 3*1) / 4; rows 2-3: the full client only
    np.testing.assert_array_equal(merged["w"][:2], np.full((2, 3), 3.25, np.float32))
    np.testing.assert_array_equal(merged["w"][2:], np.full((2, 3), 10.0, np.float32))
    np.testing.assert_array_equal(merged["b"], np.array([3.25, 3.25, 10, 10], np.float32))
    assert merged["w"].dtype == np.float32


def test_elements_no_client_covers_keep_the_global_value() -> None:
    g = _global()
    quarter = {"w": np.full((1, 3), -1.0, np.float32), "b": np.full(1, -1.0, np.float32)}
    half = {"w": np.full((2, 2), 5.0, np.float32), "b": np.full(2, 5.0, np.float32)}
    merged = aggregate_overlapping(g, [(quarter, 1.0), (half, 1.0)])
    expected_w = g["w"].copy()
    expected_w[0, :2] = 2.0  # both
    expected_w[0, 2] = -1.0  # quarter only (its row is full width)
    expected_w[1, :2] = 5.0  # half only
    np.testing.assert_array_equal(merged["w"], expected_w)  # the rest: global
    np.testing.assert_array_equal(merged["b"], np.array([2.0, 5.0, 2.0, 3.0], np.float32))


def test_overlap_average_refuses_bad_updates() -> None:
    g = _global()
    with pytest.raises(ValueError, match="at least one"):
        aggregate_overlapping(g, [])
    with pytest.raises(ValueError, match=r"weight 0\.0 must be positive"):
        aggregate_overlapping(g, [(g, 0.0)])
    with pytest.raises(ValueError, match="keys"):
        aggregate_overlapping(g, [({"w": g["w"]}, 1.0)])


def _reply(instruction: Message, arrays: dict[str, np.ndarray], n: int, ratio: float) -> Message:
    metrics = MetricRecord({"num-examples": n, WIDTH_RATIO: ratio})
    record = ArrayRecord({k: Array(v) for k, v in arrays.items()})
    return Message(RecordDict({"arrays": record, "metrics": metrics}), reply_to=instruction)


def _configure(strategy: FedAvg, grid: Nodes, arrays: dict[str, np.ndarray]) -> list[Message]:
    record = ArrayRecord({k: Array(v) for k, v in arrays.items()})
    config = ConfigRecord({"lr": 0.1})
    return list(strategy.configure_train(1, record, config, cast(Grid, grid)))


def _as_numpy(record: ArrayRecord | None) -> dict[str, Any]:
    assert record is not None
    return {k: v.numpy() for k, v in record.items()}


def test_ratio_one_everywhere_is_fedavg() -> None:
    rng = np.random.default_rng(0)
    g = {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=4)}
    updates = [{k: rng.normal(size=v.shape).astype(v.dtype) for k, v in g.items()} for _ in "abc"]
    grid, results = Nodes([1, 2, 3]), []
    for strategy in (HeteroFL(width_ratios=[1.0], min_available_nodes=3), FedAvg()):
        sent = _configure(strategy, grid, g)
        replies = [
            _reply(m, u, n, 1.0) for m, u, n in zip(sent, updates, (10, 30, 60), strict=True)
        ]
        results.append(strategy.aggregate_train(1, replies))
    (hetero, hetero_metrics), (fedavg, fedavg_metrics) = results
    for key in g:
        np.testing.assert_allclose(_as_numpy(hetero)[key], _as_numpy(fedavg)[key], rtol=1e-6)
    assert hetero_metrics == fedavg_metrics


def test_strategy_sends_ratios_then_each_node_its_slice_and_averages_overlaps() -> None:
    strategy, grid, g = HeteroFL(min_available_nodes=2), Nodes([7, 8]), _global()
    sent = _configure(strategy, grid, g)
    assert all(list(m.content["config"][WIDTH_RATIOS]) == [1.0, 0.5, 0.25, 0.125] for m in sent)
    assert all(m.content["arrays"]["w"].numpy().shape == (4, 3) for m in sent)  # not known yet
    by_node = {m.metadata.dst_node_id: m for m in sent}
    full = {"w": np.full((4, 3), 4.0, np.float32), "b": np.full(4, 4.0, np.float32)}
    half = {"w": np.full((2, 3), 1.0, np.float32), "b": np.full(2, 1.0, np.float32)}
    arrays, metrics = strategy.aggregate_train(
        1, [_reply(by_node[7], full, 1, 1.0), _reply(by_node[8], half, 2, 0.5)]
    )
    merged = _as_numpy(arrays)
    np.testing.assert_array_equal(merged["w"][:2], np.full((2, 3), 2.0, np.float32))
    np.testing.assert_array_equal(merged["w"][2:], np.full((2, 3), 4.0, np.float32))
    assert metrics is not None and metrics[WIDTH_RATIO] == pytest.approx(2 / 3)
    second = {m.metadata.dst_node_id: m for m in _configure(strategy, grid, merged)}
    assert second[7].content["arrays"]["w"].numpy().shape == (4, 3)
    np.testing.assert_array_equal(second[8].content["arrays"]["w"].numpy(), merged["w"][:2])
    assert second[8].content["arrays"]["b"].numpy().shape == (2,)


def test_budget_errors_are_dropped_and_the_rest_averaged() -> None:
    strategy, grid, g = (
        HeteroFL(width_ratios=[1.0], min_available_nodes=2),
        Nodes([1, 2]),
        _global(),
    )
    sent = _configure(strategy, grid, g)
    failed = Message(Error(code=ERROR_CODE_BUDGET, reason="too small"), reply_to=sent[1])
    arrays, _ = strategy.aggregate_train(1, [_reply(sent[0], _global(), 5, 1.0), failed])
    np.testing.assert_array_equal(_as_numpy(arrays)["w"], g["w"])
    assert strategy.aggregate_train(1, [failed]) == (None, None)
