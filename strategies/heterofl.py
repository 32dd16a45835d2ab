"""HeteroFL (Diao et al., ICLR'21): clients train width-scaled sub-models, averaged on overlaps.

A client at width ratio r trains the sub-model made of the first ceil(r * C) channels of every
hidden layer (the first layer's input channels and the last layer's classes stay full), so each
of its arrays is a leading slice ``[:s0, :s1, ...]`` of the global array of that name. The
server averages every element over the clients whose slice covers it, weighted by their example
counts; an element no client covers keeps its global value.

Who picks the ratio: the strategy sends the ratios it allows (``WIDTH_RATIOS``); each client
trains the widest one whose unmanaged training peak fits its memory budget and reports it
(``WIDTH_RATIO``). The strategy learns each node's sub-model shapes from its replies and, from
its second round on, sends it only its slice. ``width_ratios=(1.0,)`` is fits-only FedAvg: a
client whose budget is below the full model's peak replies with an error and takes no part.

Buffers are averaged on their slices like parameters: this is not HeteroFL's static BatchNorm.
"""

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from numpy.typing import NDArray

WIDTH_RATIOS = "width-ratios"  # train config: the width ratios a client may choose from
WIDTH_RATIO = "width-ratio"  # train reply metric: the ratio the client trained at
DEFAULT_WIDTH_RATIOS = (1.0, 0.5, 0.25, 0.125)  # HeteroFL's complexity levels a to d

Arrays = Mapping[str, NDArray[Any]]
Shapes = Mapping[str, tuple[int, ...]]


def scaled_width(channels: int, ratio: float) -> int:
    """HeteroFL's width of a hidden layer of ``channels`` at ``ratio``: ceil(r * C), at least 1."""
    check_ratios([ratio])
    return max(1, math.ceil(ratio * channels - 1e-9))


def check_ratios(ratios: Sequence[float]) -> tuple[float, ...]:
    """The distinct ratios, widest first.

    Raises:
        ValueError: no ratio given, or one outside (0, 1].
    """
    if not ratios:
        raise ValueError("width_ratios is empty; allow at least 1.0 (fits-only FedAvg)")
    for ratio in ratios:
        if not 0.0 < float(ratio) <= 1.0:
            raise ValueError(f"width ratio {ratio} is outside (0, 1]; use e.g. 1.0, 0.5, 0.25")
    return tuple(sorted({float(r) for r in ratios}, reverse=True))


def _leading(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def _check_covered(key: str, shape: tuple[int, ...], full: tuple[int, ...]) -> None:
    if len(shape) != len(full) or any(s > f for s, f in zip(shape, full, strict=True)):
        raise ValueError(
            f"array {key!r} of shape {shape} is no leading slice of the global shape {full}; "
            "a sub-model must keep every layer's rank and take at most its channels"
        )


def slice_to_shapes(global_arrays: Arrays, shapes: Shapes) -> dict[str, NDArray[Any]]:
    """The sub-model's arrays: the leading slice of each global array to the sub-model's shape.

    Raises:
        ValueError: the key sets differ, or a shape is no leading slice of its global array.
    """
    if set(global_arrays) != set(shapes):
        raise ValueError(
            f"sub-model keys {sorted(shapes)} differ from the global keys {sorted(global_arrays)}"
        )
    out: dict[str, NDArray[Any]] = {}
    for key, full in global_arrays.items():
        shape = tuple(shapes[key])
        _check_covered(key, shape, full.shape)
        out[key] = np.ascontiguousarray(full[_leading(shape)])
    return out


def aggregate_overlapping(
    global_arrays: Arrays, updates: Sequence[tuple[Arrays, float]]
) -> dict[str, NDArray[Any]]:
    """Each element's weighted mean over the updates whose slice covers it; else its global value.

    ``updates`` are (arrays, weight) pairs, each array a leading slice of the global one of
    its name. Sums run in float64; the result keeps each global array's dtype.

    Raises:
        ValueError: no update, a weight not positive, keys that differ, or a shape no slice.
    """
    if not updates:
        raise ValueError("aggregate_overlapping needs at least one update")
    out: dict[str, NDArray[Any]] = {}
    for arrays, weight in updates:
        if not weight > 0:
            raise ValueError(f"update weight {weight} must be positive (its example count)")
        if set(arrays) != set(global_arrays):
            raise ValueError(
                f"update keys {sorted(arrays)} differ from the global keys {sorted(global_arrays)}"
            )
    for key, full in global_arrays.items():
        total = np.zeros(full.shape, dtype=np.float64)
        weight_sum = np.zeros(full.shape, dtype=np.float64)
        for arrays, weight in updates:
            part = arrays[key]
            _check_covered(key, part.shape, full.shape)
            region = _leading(part.shape)
            total[region] += weight * part.astype(np.float64)
            weight_sum[region] += weight
        covered = weight_sum > 0
        mean = np.where(covered, total / np.where(covered, weight_sum, 1.0), full)
        if np.issubdtype(full.dtype, np.integer):
            mean = np.rint(mean)
        out[key] = mean.astype(full.dtype)
    return out


def _numpy(record: ArrayRecord) -> dict[str, NDArray[Any]]:
    return {key: array.numpy() for key, array in record.items()}


def _record(arrays: Arrays) -> ArrayRecord:
    return ArrayRecord({key: Array(np.ascontiguousarray(a)) for key, a in arrays.items()})


class HeteroFL(FedAvg):
    """FedAvg whose clients may train width-scaled sub-models (see the module docstring).

    ``width_ratios`` are the ratios clients may choose from; FedAvg's arguments pass through.
    """

    def __init__(
        self, *, width_ratios: Sequence[float] = DEFAULT_WIDTH_RATIOS, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.width_ratios = check_ratios(width_ratios)
        self._node_shapes: dict[int, dict[str, tuple[int, ...]]] = {}
        self._global: dict[str, NDArray[Any]] | None = None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's instructions, each node's arrays cut to its sub-model once it is known."""
        config[WIDTH_RATIOS] = list(self.width_ratios)
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self._global = _numpy(arrays)
        out = []
        for msg in messages:
            shapes = self._node_shapes.get(msg.metadata.dst_node_id)
            if shapes is None:  # not heard from yet: the full model, the client cuts it
                out.append(msg)
                continue
            content = RecordDict(
                {
                    self.arrayrecord_key: _record(slice_to_shapes(self._global, shapes)),
                    self.configrecord_key: config,
                }
            )
            out.append(
                Message(
                    content, dst_node_id=msg.metadata.dst_node_id, message_type=MessageType.TRAIN
                )
            )
        return out

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Average the replies' sub-models on their overlapping slices; metrics as FedAvg."""
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None
        if self._global is None:
            raise RuntimeError("HeteroFL.aggregate_train ran before configure_train of the round")
        updates = []
        for msg in valid:
            arrays = _numpy(next(iter(msg.content.array_records.values())))
            self._node_shapes[msg.metadata.src_node_id] = {k: a.shape for k, a in arrays.items()}
            metrics = next(iter(msg.content.metric_records.values()))
            updates.append((arrays, float(metrics[self.weighted_by_key])))  # type: ignore[arg-type]
        merged = aggregate_overlapping(self._global, updates)
        contents = [msg.content for msg in valid]
        return _record(merged), self.train_metrics_aggr_fn(contents, self.weighted_by_key)
