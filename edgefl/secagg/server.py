"""SecAggPlus: a strategy wrapper whose train phase is a SecAgg+ round on the Message API.

NOTE [secagg strategy]: the inner strategy samples the clients and builds their train content
(``configure_train``); the protocol then runs over the Grid (edgefl/secagg/coordinator.py); the
inner strategy finally aggregates one reply per survivor, each holding the same securely
averaged model and that survivor's clear metrics. FedAvg, FedProx, FedAvgM and FedOpt
(FedAdam, FedYogi, FedAdagrad) and client-side DP clipping thus run unchanged, with their own
reply-count checks, weighting and metric aggregation; strategies that need each client's
update are refused.
"""

import copy
import logging
from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    Bulyan,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedMedian,
    FedTrimmedAvg,
    FedXgbBagging,
    FedXgbCyclic,
    Krum,
    MultiKrum,
    QFedAvg,
    Strategy,
)
from numpy.typing import NDArray

from edgefl.errors import ConfigError
from edgefl.records import ARRAYS, METRICS, NUM_EXAMPLES
from edgefl.secagg.coordinator import run_round
from edgefl.secagg.errors import SecAggAbortedError, SecAggError
from edgefl.secagg.protocol import MaskingParams, ProtocolConfig, Stage
from edgefl.secagg.wire import only

logger = logging.getLogger(__name__)
# Strategies that read individual updates (robust statistics, per-client clipping or losses).
NEEDS_INDIVIDUAL_UPDATES = (
    FedMedian,
    FedTrimmedAvg,
    Krum,
    MultiKrum,
    Bulyan,
    QFedAvg,
    FedXgbBagging,
    FedXgbCyclic,
    DifferentialPrivacyServerSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
)


class SecAggPlus(Strategy):
    """Secure aggregation (SecAgg+) around a weighted-mean strategy.

    Args:
        strategy: the inner strategy; it samples clients and turns the mean into the model.
        num_shares: neighbourhood size of each client, itself included (odd, >= 3); a value
            of at least the number of sampled clients makes every pair neighbours (SecAgg).
        reconstruction_threshold: shares needed to rebuild a client's secret; more than half
            of ``num_shares`` and at most it. A round survives while every client keeps this
            many neighbours.
        clipping_range: the largest |weight/max_weight x update| per value kept (update = new
            minus sent model); larger values are clipped.
        quantization_range: integer levels over [-clipping_range, clipping_range].
        modulus_range: power of two; sums are taken mod it (uint32 on the wire up to 2**32).
        max_weight: the largest example count a client may report.
        timeout_s: per key stage (setup, share-keys, unmask); training uses the round timeout.
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        num_shares: int,
        reconstruction_threshold: int,
        clipping_range: float = 1.0,
        quantization_range: int = 2**22,
        modulus_range: int = 2**32,
        max_weight: int = 10_000,
        timeout_s: float = 600.0,
    ) -> None:
        _check_inner(strategy)
        if num_shares < 3 or num_shares % 2 == 0:
            raise ConfigError(f"num_shares={num_shares} must be odd and >= 3 (a symmetric ring)")
        t = reconstruction_threshold
        if not num_shares < 2 * t or t > num_shares:
            raise ConfigError(
                f"reconstruction_threshold={t} must be in ({num_shares / 2:g}, {num_shares}] "
                f"for num_shares={num_shares}: above half, so shares of both secrets of one "
                "client can never be collected"
            )
        params = MaskingParams(clipping_range, quantization_range, modulus_range, max_weight)
        params.check(max_clients=1)
        self.strategy = strategy
        self.protocol = ProtocolConfig(num_shares, t, params, _weight_key(strategy), timeout_s)

    def __repr__(self) -> str:
        """Name, protocol parameters and the inner strategy."""
        return f"SecAggPlus({self.protocol}, strategy={self.strategy!r})"

    def train_round(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        grid: Grid,
        timeout_s: float,
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Train one round under SecAgg+; raise SecAggAbortedError if too many drop out."""
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        if not messages:
            logger.warning("round %d: the strategy sampled no clients", server_round)
            return None, None
        self.protocol.params.check(max_clients=len(messages))
        if len(messages) < self.protocol.threshold:
            raise SecAggAbortedError(
                f"round {server_round}: {len(messages)} clients sampled, fewer than "
                f"reconstruction_threshold={self.protocol.threshold}; sample more clients",
                server_round,
                str(Stage.SETUP),
            )
        content = {m.metadata.dst_node_id: m.content for m in messages}
        length = sum(a.numpy().size for a in arrays.values())
        outcome = run_round(grid, server_round, content, length, self.protocol, timeout_s)
        mean = _add_delta(arrays, outcome.mean_delta)
        replies = [_with_arrays(reply, mean) for reply in outcome.replies]
        aggregated, metrics = self.strategy.aggregate_train(server_round, replies)
        self._check_precision(outcome.total_weight, len(outcome.replies))
        bound = self.protocol.params.error_bound(len(outcome.replies), outcome.total_weight)
        info: dict[str, int | float] = {"secagg-error-bound": bound}
        info |= {f"secagg-{k}-clients": v for k, v in outcome.clients.items()}
        info |= {f"secagg-{k}-s": v for k, v in outcome.stage_s.items()}
        return aggregated, MetricRecord({**(metrics or {}), **info})

    def _check_precision(self, total_weight: int, num_clients: int) -> None:
        """Warn when max_weight dwarfs the clients' weights: the error grows by that ratio."""
        ratio = self.protocol.params.max_weight * num_clients / total_weight
        if ratio > 100:
            logger.warning(
                "SecAgg+: max_weight=%d is %.0fx the clients' mean weight; the quantisation "
                "error grows by that factor. Set max_weight near the largest client's %s "
                "(1 for unit weights)",
                self.protocol.params.max_weight,
                ratio,
                self.protocol.weight_key,
            )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Message]:
        """Refused: a plain train exchange would bypass secure aggregation."""
        raise SecAggError(
            "SecAggPlus trains through train_round (edgefl.rounds.run_rounds calls it); "
            "Strategy.start and plain configure_train would send updates unmasked"
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Refused: see configure_train."""
        raise SecAggError("SecAggPlus aggregates inside train_round; see configure_train")

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Message]:
        """Delegate to the inner strategy."""
        return list(self.strategy.configure_evaluate(server_round, arrays, config, grid))

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Delegate to the inner strategy."""
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        """Log the protocol parameters, then the inner strategy's summary."""
        p = self.protocol
        logger.info(
            "SecAgg+: %d shares, threshold %d, clip %g, %d levels, modulus 2**%d, max weight %d",
            p.num_shares,
            p.threshold,
            p.params.clipping_range,
            p.params.quantization_range,
            p.params.modulus_range.bit_length() - 1,
            p.params.max_weight,
        )
        self.strategy.summary()


def _check_inner(strategy: Strategy) -> None:
    """Refuse strategies (or wrapped ones) that need each client's update."""
    inner: object = strategy
    while inner is not None:
        if isinstance(inner, NEEDS_INDIVIDUAL_UPDATES):
            raise ConfigError(
                f"SecAggPlus cannot wrap {type(inner).__name__}: it needs each client's "
                "update, which secure aggregation hides. Use FedAvg, FedProx, FedAvgM, FedAdam, "
                "FedYogi or FedAdagrad (with client-side DP clipping if needed)"
            )
        inner = getattr(inner, "strategy", None)


def _weight_key(strategy: Strategy) -> str:
    """The reply metric the innermost weighted strategy averages by (DP wrappers have none)."""
    inner: object = strategy
    while inner is not None:
        key = getattr(inner, "weighted_by_key", None)
        if isinstance(key, str):
            return key
        inner = getattr(inner, "strategy", None)
    return NUM_EXAMPLES


def _add_delta(arrays: ArrayRecord, delta: NDArray[np.float64]) -> ArrayRecord:
    """``arrays`` plus the flat ``delta``, each array keeping its shape and dtype."""
    out, offset = {}, 0
    for key, array in arrays.items():
        value = array.numpy()
        new = value + delta[offset : offset + value.size].reshape(value.shape)
        out[key] = Array(np.asarray(np.rint(new) if value.dtype.kind in "iu" else new, value.dtype))
        offset += value.size
    assert offset == delta.size, "the decoded vector has the model's length"
    return ArrayRecord(out)


def _with_arrays(reply: Message, arrays: ArrayRecord) -> Message:
    """A copy of a survivor's reply holding ``arrays`` and its clear metrics.

    A copy: the Grid's observers may keep the reply as it arrived (the masked vector).
    """
    synthetic = copy.copy(reply)
    metrics = only(reply.content.metric_records, "MetricRecord in a collect reply")
    synthetic.content = RecordDict({ARRAYS: arrays, METRICS: metrics})
    return synthetic
