"""The server's round loop: train, evaluate and checkpoint, from any round, over a Flower strategy.

NOTE [own round loop]: Flower 1.42's ``Strategy.start`` always counts rounds from 1, has no hook
between rounds and runs one message exchange per train phase. edgefl needs a run that resumes at
round k+1 with the clients' per-round seeds unchanged (checkpoint and resume), a check before each
round (a privacy budget that would be exceeded ends the run), a hook after it (the checkpoint),
and train phases of several exchanges (secure aggregation). So this loop drives the strategy
through its public methods, in the same order as ``Strategy.start``: configure_train ->
send_and_receive -> aggregate_train -> configure_evaluate -> send_and_receive ->
aggregate_evaluate -> central evaluation.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from edgefl.errors import EdgeFLError

logger = logging.getLogger(__name__)

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


@runtime_checkable
class TrainRound(Protocol):
    """A strategy whose train phase is more than one exchange (e.g. secure aggregation).

    The loop calls ``train_round`` instead of configure_train -> send_and_receive ->
    aggregate_train; it returns the new global arrays (None keeps the old ones) and metrics.
    """

    def train_round(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        grid: Grid,
        timeout_s: float,
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Run round ``server_round``'s train phase over ``grid``; aggregate it."""
        ...


class StopRun(EdgeFLError):
    """Raised by a ``before_round`` check to end the run cleanly before that round."""


class RoundAborted(EdgeFLError):
    """A train phase that could not complete; the model and strategy state are unchanged.

    The loop logs it and goes on with the next round, as Flower's strategies do when too few
    clients reply.
    """


@dataclass(frozen=True)
class RoundPlan:
    """Which rounds to run and what the clients are told."""

    first_round: int  # 1 for a new run; k+1 when resuming after round k
    num_rounds: int  # the last round
    timeout_s: float
    train_config: ConfigRecord
    evaluate_config: ConfigRecord


@dataclass
class LoopResult:
    """The global model after the last round that ran, and why the loop ended."""

    arrays: ArrayRecord
    last_round: int  # the last round completed (first_round - 1 if none ran)
    stopped_early: str | None = None  # the reason, when a before_round check ended the run
    train_metrics: dict[int, MetricRecord] = field(default_factory=dict)
    evaluate_metrics: dict[int, MetricRecord] = field(default_factory=dict)


def run_rounds(
    strategy: Strategy,
    grid: Grid,
    arrays: ArrayRecord,
    plan: RoundPlan,
    *,
    evaluate_fn: EvaluateFn | None = None,
    before_round: Callable[[int], None] | None = None,
    after_round: Callable[[int, ArrayRecord], None] | None = None,
) -> LoopResult:
    """Run rounds ``plan.first_round``..``plan.num_rounds`` and return the final model.

    ``evaluate_fn(round, arrays)`` runs on the starting model of a new run (as round 0; a
    resumed run's starting model was evaluated by the run it resumes) and after every round;
    ``before_round(r)`` may raise ``StopRun`` to end the run before round r;
    ``after_round(r, arrays)`` runs once round r is complete (e.g. a checkpoint).
    """
    strategy.summary()
    result = LoopResult(arrays, plan.first_round - 1)
    if evaluate_fn is not None and plan.first_round == 1:
        evaluate_fn(0, arrays)
    for server_round in range(plan.first_round, plan.num_rounds + 1):
        if before_round is not None:
            try:
                before_round(server_round)
            except StopRun as exc:
                logger.warning("stopping before round %d: %s", server_round, exc)
                result.stopped_early = str(exc)
                break
        new_arrays, metrics = _train(strategy, grid, server_round, result.arrays, plan)
        if new_arrays is not None:
            result.arrays = new_arrays
        if metrics is not None:
            result.train_metrics[server_round] = metrics
        replies = grid.send_and_receive(
            strategy.configure_evaluate(server_round, result.arrays, plan.evaluate_config, grid),
            timeout=plan.timeout_s,
        )
        evaluated = strategy.aggregate_evaluate(server_round, replies)
        if evaluated is not None:
            result.evaluate_metrics[server_round] = evaluated
        if evaluate_fn is not None:
            evaluate_fn(server_round, result.arrays)
        result.last_round = server_round
        if after_round is not None:
            after_round(server_round, result.arrays)
    return result


def _train(
    strategy: Strategy, grid: Grid, server_round: int, arrays: ArrayRecord, plan: RoundPlan
) -> tuple[ArrayRecord | None, MetricRecord | None]:
    if isinstance(strategy, TrainRound):
        try:
            return strategy.train_round(
                server_round, arrays, plan.train_config, grid, plan.timeout_s
            )
        except RoundAborted as exc:
            logger.warning("round %d: training aborted, model unchanged: %s", server_round, exc)
            return None, None
    replies = grid.send_and_receive(
        strategy.configure_train(server_round, arrays, plan.train_config, grid),
        timeout=plan.timeout_s,
    )
    return strategy.aggregate_train(server_round, replies)
