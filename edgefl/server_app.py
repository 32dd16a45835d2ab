"""Flower ServerApp: settings -> strategy -> start with central evaluation -> results and plots."""

import copy
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from edgefl.client_data import central_test_set
from edgefl.config import instantiate_strategy, settings_from_run_config
from edgefl.history import RunHistory
from edgefl.log_setup import configure_logging
from edgefl.models import build_model
from edgefl.peak import PeakMeasurement, measure_unmanaged_peak
from edgefl.plots import ACCURACY_PNG, MEMORY_PNG, plot_accuracy_loss, plot_client_memory
from edgefl.recording_grid import Exchange, ExchangeObserver, RecordingGrid
from edgefl.results import SUMMARY_TXT, write_results
from edgefl.settings import RunSettings
from edgefl.summary import round_line, summary_table
from edgefl.train import evaluate

logger = logging.getLogger(__name__)


def build_server_app(
    settings: RunSettings | None = None,
    observers: Sequence[ExchangeObserver] = (),
    outcome: dict[str, Any] | None = None,
    peak: PeakMeasurement | None = None,
) -> ServerApp:
    """A ServerApp using ``settings``, or (for ``flwr run``) settings from the run config.

    ``observers`` see every exchange; ``outcome`` (if given) receives the run's history, final
    state and output folder; ``peak`` is the model's unmanaged training peak if already
    measured (else it is measured here).
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        s = settings if settings is not None else settings_from_run_config(context.run_config)
        result = run_federation(grid, s, observers, peak)
        if outcome is not None:
            outcome.update(result)

    return app


def run_federation(
    grid: Grid,
    s: RunSettings,
    observers: Sequence[ExchangeObserver] = (),
    peak: PeakMeasurement | None = None,
) -> dict[str, Any]:
    """Run the strategy for ``num_rounds`` and write results; return history, state and paths."""
    configure_logging(s.simulation.flower_log_level)
    out_dir = Path(s.server.output_dir)
    strategy = instantiate_strategy(s.server.strategy)
    info, test_set = central_test_set(s.client.data, s.client.seed)
    torch.manual_seed(s.client.seed)
    model = build_model(s.client.model.name, info, s.client.model.options)
    if peak is None:  # flwr run: measure here, with the clients' thread count
        torch.set_num_threads(s.client.train.torch_threads)
        peak = measure_unmanaged_peak(copy.deepcopy(model), test_set, s.client.train.batch_size)
    logger.info(
        "model %s (%d parameters) on %s: unmanaged training peak %.1f MiB at batch %d; budgets %s",
        s.client.model.name,
        sum(p.numel() for p in model.parameters()),
        info.name,
        peak.unmanaged_peak_bytes / 2**20,
        s.client.train.batch_size,
        ", ".join(f"{c.name} {c.budget}" for c in s.client.fleet.classes),
    )
    history = RunHistory()

    def central_eval(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        outcome = None
        if s.server.central_eval:
            model.load_state_dict(arrays.to_torch_state_dict())
            outcome = evaluate(model, test_set, s.client.train.eval_batch_size)
        logger.info(
            "%s", round_line(history.close_round(server_round, outcome), s.server.num_rounds)
        )
        if outcome is None:
            return None
        return MetricRecord({"central-loss": outcome.loss, "central-acc": outcome.accuracy})

    started = time.perf_counter()
    result = strategy.start(
        grid=RecordingGrid(grid, [history.on_exchange, _log_errors, *observers]),
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=s.server.num_rounds,
        timeout=s.server.round_timeout_s,
        train_config=ConfigRecord(
            {
                "lr": s.client.train.lr,
                "seed": s.client.seed,
                "local-epochs": s.client.train.local_epochs,
                "batch-size": s.client.train.batch_size,
            }
        ),
        evaluate_config=ConfigRecord({"seed": s.client.seed}),
        evaluate_fn=central_eval,
    )
    final_state = result.arrays.to_torch_state_dict()
    extra = {
        "unmanaged_peak_bytes": peak.unmanaged_peak_bytes,
        "min_budget_bytes": peak.min_budget_bytes,
        "strategy_s": time.perf_counter() - started,
    }
    paths = write_results(out_dir, history, final_state, s, extra)
    if s.server.save_plots:
        paths.append(plot_accuracy_loss(history, out_dir / ACCURACY_PNG))
        paths.append(
            plot_client_memory(
                history, s.client.fleet.classes, peak.unmanaged_peak_bytes, out_dir / MEMORY_PNG
            )
        )
    table = summary_table(history)
    (out_dir / SUMMARY_TXT).write_text(table + "\n")
    logger.info("summary of the run:\n%s", table)
    logger.info("results in %s: %s", out_dir, ", ".join(p.name for p in paths))
    return {
        "history": history,
        "final_state": final_state,
        "output_dir": out_dir,
        "unmanaged_peak_bytes": peak.unmanaged_peak_bytes,
    }


def _log_errors(exchange: Exchange) -> None:
    """Log every error reply (Flower's strategies log them at INFO, hidden by default)."""
    for reply in exchange.replies:
        if reply.has_error():
            logger.warning(
                "round %d %s: node %d replied with error %d: %s",
                exchange.server_round,
                exchange.message_type,
                reply.metadata.src_node_id,
                reply.error.code,
                reply.error.reason,
            )


app: ServerApp = build_server_app()
