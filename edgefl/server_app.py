"""Flower ServerApp: settings -> strategy -> start with central evaluation -> results and plots."""

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy
from flwr.superlink.grid import InMemoryGrid
from torch import nn

from edgefl.checkpoint import (
    Checkpoint,
    capture_rng,
    load_checkpoint,
    restore_rng,
    run_key,
    save_checkpoint,
)
from edgefl.client_data import central_test_set
from edgefl.config import instantiate_strategy, settings_from_run_config
from edgefl.data import ArrayDataset
from edgefl.errors import ConfigError
from edgefl.history import RunHistory
from edgefl.log_setup import configure_logging
from edgefl.models import build_model
from edgefl.outputs import write_outputs
from edgefl.peak import PeakMeasurement, measure_floors
from edgefl.privacy import (
    PrivacyBudgetExhausted,
    PrivacyGuard,
    num_sampled_clients,
    wrap_strategy,
)
from edgefl.progress import TrainProgress
from edgefl.recording_grid import Exchange, ExchangeObserver, RecordingGrid
from edgefl.records import BATCH_SIZE, CENTRAL_ACC, CENTRAL_LOSS, LOCAL_EPOCHS, LR, SEED
from edgefl.reference import ReferenceRound, time_unmanaged_round
from edgefl.results import CENTRAL_ACC_NAME
from edgefl.rounds import RoundPlan, StopRun, run_rounds
from edgefl.secagg import SecAggPlus
from edgefl.settings import RunSettings
from edgefl.summary import round_line
from edgefl.train import evaluate
from strategies.memory_aware import MemoryAware

logger = logging.getLogger(__name__)


def build_server_app(
    settings: RunSettings | None = None,
    observers: Sequence[ExchangeObserver] = (),
    outcome: dict[str, Any] | None = None,
    peak: PeakMeasurement | None = None,
    reference: ReferenceRound | None = None,
) -> ServerApp:
    """A ServerApp using ``settings``, or (for ``flwr run``) settings from the run config.

    ``observers`` see every exchange; ``outcome`` (if given) receives the run's history, final
    state and output folder; ``peak`` is the model's unmanaged training peak if already
    measured (else it is measured here); ``reference`` the unmanaged reference round
    (NOTE [reference round]; else timed here).
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        s = settings if settings is not None else settings_from_run_config(context.run_config)
        result = run_federation(grid, s, observers, peak, reference)
        if outcome is not None:
            outcome.update(result)

    return app


def run_federation(
    grid: Grid,
    s: RunSettings,
    observers: Sequence[ExchangeObserver] = (),
    peak: PeakMeasurement | None = None,
    reference: ReferenceRound | None = None,
) -> dict[str, Any]:
    """Run rounds up to ``num_rounds`` (from a checkpoint if resuming); write results.

    Returns the history, final state, output folder, the files written there (``result_files``)
    and the model's unmanaged peak.
    """
    configure_logging(s.simulation.flower_log_level)
    out_dir = Path(s.server.output_dir)
    info, test_set = central_test_set(s.client.data, s.client.seed)
    torch.manual_seed(s.client.seed)
    model = build_model(s.client.model.name, info, s.client.model.options)
    key = run_key(s)
    # Deployed clients train on their own devices: a round timed here says nothing of theirs.
    simulated = isinstance(grid, InMemoryGrid)
    start = _starting_state(s, key, model, test_set, peak, reference, simulated)
    _log_model(s, model, info.name, start.extra)
    guard = _privacy_guard(s, start.strategy)
    hooks = _RoundHooks(s, model, test_set, start, guard, key, out_dir, info.accuracy)
    started = time.perf_counter()
    result = run_rounds(
        start.strategy,
        RecordingGrid(
            grid, [start.history.on_exchange, ErrorLog(), *observers], TrainProgress().update
        ),
        ArrayRecord(model.state_dict()),
        _round_plan(s, start.first_round),
        evaluate_fn=hooks.central_eval,
        before_round=hooks.before_round,
        after_round=hooks.checkpoint,
    )
    final_state = result.arrays.to_torch_state_dict()
    summary = {
        **start.extra,
        "strategy_s": time.perf_counter() - started,
        "resumed_after": start.first_round - 1,
        "stopped_early": result.stopped_early,
        CENTRAL_ACC_NAME: info.accuracy,
    }
    unmanaged_peak_bytes = start.extra["unmanaged_peak_bytes"]
    files = write_outputs(out_dir, s, start.history, final_state, summary, unmanaged_peak_bytes)
    return {
        "history": start.history,
        "final_state": final_state,
        "output_dir": out_dir,
        "result_files": files,
        "unmanaged_peak_bytes": unmanaged_peak_bytes,
        "last_round": result.last_round,
    }


@dataclasses.dataclass
class _Start:
    """Where a run starts: a new run, or the checkpoint it resumes."""

    strategy: Strategy
    history: RunHistory
    first_round: int
    extra: dict[str, Any]  # measured once per run: unmanaged peak, least budget, reference


def _starting_state(
    s: RunSettings,
    key: dict[str, Any],
    model: nn.Module,
    test_set: ArrayDataset,
    peak: PeakMeasurement | None,
    reference: ReferenceRound | None,
    time_reference: bool,
) -> _Start:
    """Resume the checkpoint (loading ``model`` and the RNGs from it), or start a new run.

    A new run times the reference round here if not given one and ``time_reference``.
    """
    resumed = _resume(s, key)
    if resumed is not None:
        model.load_state_dict(resumed.state_dict)
        restore_rng(resumed.rng)
        resumed.history.restart_clock()
        return _Start(resumed.strategy, resumed.history, resumed.server_round + 1, resumed.extra)
    strategy, history = build_strategy(s), RunHistory()  # its clock starts here
    if peak is None:  # flwr run: measure here, with the clients' thread count
        torch.set_num_threads(s.client.train.torch_threads)
        peak = measure_floors(
            model,
            test_set,
            s.client.train.batch_size,
            lr=s.client.train.lr,
            momentum=s.client.train.momentum,
            settings=s.client.vtensor if s.client.vtensor.enabled else None,
        )
    if reference is None and time_reference:
        reference = time_unmanaged_round(s.client, s.server.num_supernodes)
    extra: dict[str, Any] = {
        "unmanaged_peak_bytes": peak.unmanaged_peak_bytes,
        "min_budget_bytes": peak.min_budget_bytes,
        "state_bytes": peak.state_bytes,
        "peak_batch_size": peak.batch_size,
        "smaller_batch_peaks": [list(pair) for pair in peak.smaller_batch_peaks],
    }
    if reference is not None:  # else not measured: no "x unmanaged" (``_reference``)
        extra["reference_train_s"] = reference.train_s
        extra["reference_examples_processed"] = reference.examples_processed
        extra["reference_cpu_s"] = reference.cpu_s
    return _Start(strategy, history, 1, extra)


def _log_model(s: RunSettings, model: nn.Module, dataset: str, extra: dict[str, Any]) -> None:
    reference = (
        f"an unmanaged client trains a round in {extra['reference_train_s']:.2f} s"
        if "reference_train_s" in extra
        else "the clients' unmanaged round time is not measured (they train on other machines)"
    )
    logger.info(
        "model %s (%d parameters) on %s: unmanaged training peak %.1f MiB at batch %d "
        "(measured by the server); %s",
        s.client.model.name,
        sum(p.numel() for p in model.parameters()),
        dataset,
        extra["unmanaged_peak_bytes"] / 2**20,
        s.client.train.batch_size,
        reference,
    )


@dataclasses.dataclass
class _RoundHooks:
    """``run_rounds``' callbacks: the privacy budget check, central evaluation, checkpoints.

    ``model`` is the server's copy, loaded with each round's arrays for central evaluation.
    """

    s: RunSettings
    model: nn.Module
    test_set: ArrayDataset
    start: _Start
    guard: PrivacyGuard
    key: dict[str, Any]
    out_dir: Path
    accuracy: str  # what the central accuracy counts (DatasetInfo.accuracy)

    def before_round(self, server_round: int) -> None:
        try:
            self.guard.before_round(server_round)
        except PrivacyBudgetExhausted as exc:
            raise StopRun(str(exc)) from exc

    def central_eval(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        s = self.s
        outcome = None
        if s.server.central_eval:
            self.model.load_state_dict(arrays.to_torch_state_dict())
            outcome = evaluate(self.model, self.test_set, s.client.train.eval_batch_size)
        record = self.start.history.close_round(server_round, outcome, self.guard.epsilon())
        logger.info("%s", round_line(record, s.server.num_rounds, self.accuracy))
        if outcome is None:
            return None
        return MetricRecord({CENTRAL_LOSS: outcome.loss, CENTRAL_ACC: outcome.accuracy})

    def checkpoint(self, server_round: int, arrays: ArrayRecord) -> None:
        if self.s.server.checkpoint:
            state = Checkpoint(
                server_round,
                arrays.to_torch_state_dict(),
                self.start.strategy,
                self.start.history,
                self.key,
                capture_rng(),
                self.start.extra,
            )
            save_checkpoint(self.out_dir, state)


def _round_plan(s: RunSettings, first_round: int) -> RoundPlan:
    """Rounds ``first_round``..``num_rounds`` and the configs sent with each."""
    return RoundPlan(
        first_round=first_round,
        num_rounds=s.server.num_rounds,
        timeout_s=s.server.round_timeout_s,
        train_config=ConfigRecord(
            {
                LR: s.client.train.lr,
                SEED: s.client.seed,
                LOCAL_EPOCHS: s.client.train.local_epochs,
                BATCH_SIZE: s.client.train.batch_size,
            }
        ),
        evaluate_config=ConfigRecord({SEED: s.client.seed}),
    )


def build_strategy(s: RunSettings) -> Strategy:
    """The configured Flower strategy, wrapped for DP, pacing and secure aggregation when asked.

    DP innermost (its noise is calibrated to the plain mean it wraps), secure aggregation
    outermost (it runs the train phase's exchanges).
    """
    strategy: Strategy = instantiate_strategy(s.server.strategy)
    if s.client.privacy.central:
        sampled = num_sampled_clients(strategy, s.server.num_supernodes)
        strategy = wrap_strategy(strategy, s.client.privacy, sampled)
    if s.server.pacing is not None:
        strategy = MemoryAware(strategy, **dataclasses.asdict(s.server.pacing))
    if s.server.secagg is not None:
        secagg = dataclasses.asdict(s.server.secagg)
        if s.client.privacy.central:  # every client weighs 1: scale by 1, not by max_weight
            secagg["max_weight"] = 1
        strategy = SecAggPlus(strategy, **secagg)
    return strategy


def _privacy_guard(s: RunSettings, strategy: Strategy) -> PrivacyGuard:
    """The guard of the run's privacy budget, reading the accountant of the DP wrapper inside."""
    layer: object = strategy
    while s.client.privacy.central and not hasattr(layer, "accountant"):
        layer = getattr(layer, "strategy")  # noqa: B009 - the wrappers' documented attribute
    return PrivacyGuard(s.client.privacy, cast(Strategy, layer))


def resume_point(s: RunSettings) -> Checkpoint | None:
    """The checkpoint a run continues from, or None for a new run.

    Raises:
        ConfigError: no usable checkpoint there, or its run already reached ``num_rounds``.
    """
    return _resume(s, run_key(s))


def _resume(s: RunSettings, key: dict[str, Any]) -> Checkpoint | None:
    if s.server.resume_from is None:
        return None
    checkpoint = load_checkpoint(Path(s.server.resume_from), key)
    if checkpoint.server_round >= s.server.num_rounds:
        raise ConfigError(
            f"the run in {s.server.resume_from} already completed round "
            f"{checkpoint.server_round} of num_rounds={s.server.num_rounds}; "
            "raise num_rounds to train further"
        )
    logger.info(
        "resuming %s after round %d of %d",
        s.server.resume_from,
        checkpoint.server_round,
        s.server.num_rounds,
    )
    return checkpoint


class ErrorLog:
    """Log each node's error replies (Flower's strategies log them at INFO, hidden by default).

    A node's first reply with an error code is logged with its reason; the same error from it
    in later rounds only at DEBUG: the round lines count failures, summary.txt has every reason.
    """

    def __init__(self) -> None:
        self._said: set[tuple[int, int]] = set()  # (node, error code)

    def __call__(self, exchange: Exchange) -> None:
        """Log the error replies of ``exchange`` (an observer of the RecordingGrid)."""
        for reply in exchange.replies:
            if not reply.has_error():
                continue
            said = (reply.metadata.src_node_id, reply.error.code)
            logger.log(
                logging.DEBUG if said in self._said else logging.WARNING,
                "round %d %s: node %d replied with error %d: %s",
                exchange.server_round,
                exchange.message_type,
                reply.metadata.src_node_id,
                reply.error.code,
                reply.error.reason,
            )
            self._said.add(said)


app: ServerApp = build_server_app()
