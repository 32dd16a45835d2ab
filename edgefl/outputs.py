"""What a finished run leaves in its folder: the results, the plots and the summary tables."""

import logging
from pathlib import Path
from typing import Any

import torch

from edgefl.checkpoint import CHECKPOINT_FILE
from edgefl.history import RunHistory
from edgefl.peak import PeakMeasurement
from edgefl.plots import ACCURACY_PNG, MEMORY_PNG, plot_accuracy_loss, plot_client_memory
from edgefl.reference import ReferenceRound
from edgefl.results import CENTRAL_ACC_NAME, SUMMARY_TXT, write_results
from edgefl.settings import RunSettings
from edgefl.summary import class_table, summary_table

logger = logging.getLogger(__name__)


def write_outputs(
    out_dir: Path,
    s: RunSettings,
    history: RunHistory,
    final_state: dict[str, torch.Tensor],
    summary: dict[str, Any],
    unmanaged_peak_bytes: int,
) -> list[Path]:
    """Results, plots (if asked) and the summary table in ``out_dir``; log and return them.

    The list is the one listing of a run's files: ``edgefl-sim`` prints it as it is logged here.
    """
    paths = write_results(out_dir, history, final_state, s, summary)
    if s.server.save_plots:
        accuracy_png = out_dir / ACCURACY_PNG
        paths.append(plot_accuracy_loss(history, accuracy_png, summary[CENTRAL_ACC_NAME]))
        paths.append(
            plot_client_memory(
                history,
                s.client.fleet.classes,
                unmanaged_peak_bytes,
                out_dir / MEMORY_PNG,
                state_bytes=floors_of(summary).state_bytes,
            )
        )
    table = summary_table(history, summary[CENTRAL_ACC_NAME])
    classes = class_table(
        history, s.client.fleet.classes, floors_of(summary), reference_of(summary)
    )
    (out_dir / SUMMARY_TXT).write_text(f"{table}\n\n{classes}\n")
    paths.append(out_dir / SUMMARY_TXT)
    if s.server.checkpoint and (out_dir / CHECKPOINT_FILE).is_file():
        paths.append(out_dir / CHECKPOINT_FILE)
    logger.info("summary of the run:\n%s", table)
    logger.info("per device class (and what would train without vtensor):\n%s", classes)
    logger.info("results in %s: %s", out_dir, ", ".join(p.name for p in paths))
    return paths


def floors_of(extra: dict[str, Any]) -> PeakMeasurement:
    """The floors measured at the run's start, as kept in its figures (and checkpoints)."""
    return PeakMeasurement(
        extra["unmanaged_peak_bytes"],
        extra["min_budget_bytes"],
        extra.get("state_bytes", 0),
        extra.get("peak_batch_size", 0),
        tuple((int(b), int(p)) for b, p in extra.get("smaller_batch_peaks", ())),
    )


def reference_of(extra: dict[str, Any]) -> ReferenceRound | None:
    """The reference round kept in a run's figures (None for a checkpoint of an older run)."""
    if "reference_train_s" not in extra:
        return None
    return ReferenceRound(
        extra["reference_train_s"],
        extra["reference_examples_processed"],
        extra.get("reference_cpu_s", 0.0),  # 0: a checkpoint of a run that did not measure it
    )
