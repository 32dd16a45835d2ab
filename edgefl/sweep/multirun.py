"""Hydra multirun of simulations: each job into its Hydra job folder, a sweep summary at the end.

NOTE [failed jobs]: Hydra's BasicSweeper re-raises the first failed job's exception after its
batch, and ``on_multirun_end`` callbacks then never run. A job therefore catches its own error,
records it in its folder (job_status.json) and returns normally, so later jobs and the summary
still happen; ``run_multirun`` turns recorded failures into a nonzero exit code.
"""

import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback

from edgefl.config import conf_dir, run_settings
from edgefl.errors import EdgeFLError
from edgefl.settings import RunSettings
from edgefl.sweep.plot import SUMMARY_PNG, plot_sweep
from edgefl.sweep.summary import (
    SUMMARY_CSV,
    SUMMARY_MD,
    JobState,
    JobStatus,
    job_dirs,
    job_row,
    write_job_status,
    write_summary_csv,
    write_summary_md,
)

logger = logging.getLogger(__name__)
MULTIRUN_FLAGS = ("-m", "--multirun")
EXIT_JOB_FAILED = 1
EXIT_NOT_STARTED = 2  # as edgefl-sim's single runs exit on bad config
SimulateJob = Callable[[RunSettings], object]


def is_multirun(args: Sequence[str]) -> bool:
    """Whether command-line ``args`` ask for a Hydra multirun."""
    return any(a in MULTIRUN_FLAGS for a in args)


def run_multirun(args: Sequence[str], simulate_job: SimulateJob) -> int:
    """Run Hydra's multirun of ``args`` (overrides and -m), one ``simulate_job`` per job.

    Returns 0 if every job succeeded, 1 if any failed (see NOTE [failed jobs]), 2 if the sweep
    did not start (overrides that do not compose; Hydra printed why).
    """
    failed: list[str] = []

    def task(cfg: Any) -> None:
        if not run_job(cfg, simulate_job):
            failed.append(Path(HydraConfig.get().runtime.output_dir).name)

    # hydra.main reads sys.argv. --config-dir names conf/ by absolute path: a config_path
    # would be taken relative to this package.
    main = hydra.main(config_path=None, config_name="config", version_base="1.3")(task)
    argv = sys.argv
    sys.argv = [argv[0], "--config-dir", str(conf_dir()), *args]
    try:
        main()
    except SystemExit as exc:  # Hydra reports errors outside jobs, then exits 1
        if exc.code not in (None, 0):
            return EXIT_NOT_STARTED
    finally:
        sys.argv = argv
    if failed:
        logger.error("%d job(s) failed: %s (see the sweep summary)", len(failed), ", ".join(failed))
        return EXIT_JOB_FAILED
    return 0


def run_job(cfg: Any, simulate_job: SimulateJob) -> bool:
    """Simulate one job's config into its Hydra job folder; record how it ended there.

    Returns whether it succeeded; raises no Exception (NOTE [failed jobs]).
    """
    hydra_cfg = HydraConfig.get()
    job_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = tuple(str(o) for o in hydra_cfg.overrides.task)
    started = time.perf_counter()
    error = ""
    with _job_log_file():
        logger.info("job %s: %s -> %s", hydra_cfg.job.num, " ".join(overrides), job_dir)
        try:
            if cfg.get("output_dir"):
                logger.warning(
                    "output_dir=%s is ignored in a multirun: each job writes into its job "
                    "folder; use hydra.sweep.dir=%s to place the sweep there",
                    cfg.output_dir,
                    cfg.output_dir,
                )
            # run_settings, not load_run_settings: composing again would clear the global
            # Hydra state this multirun runs in
            settings = run_settings(cfg)
            server = dataclasses.replace(settings.server, output_dir=str(job_dir))
            simulate_job(dataclasses.replace(settings, server=server))
        except Exception as exc:
            lines = str(exc).strip().splitlines()
            error = type(exc).__name__ + (f": {lines[0]}" if lines else "")
            if isinstance(exc, EdgeFLError):  # an actionable message: no traceback needed
                logger.error("job %s failed: %s", hydra_cfg.job.num, exc)
            else:
                logger.exception("job %s failed", hydra_cfg.job.num)
    state = JobState.FAILED if error else JobState.OK
    write_job_status(job_dir, JobStatus(state, error, overrides, time.perf_counter() - started))
    return not error


@contextlib.contextmanager
def _job_log_file() -> Iterator[None]:
    """Send edgefl's and Flower's log lines to the job's log file too, not twice to the console.

    Hydra points the root logger at the console and <job folder>/<job name>.log; edgefl and
    Flower print through handlers of their own, so they would otherwise either miss the file
    (edgefl does not propagate) or print twice (Flower does).
    """
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    loggers = [logging.getLogger(name) for name in ("edgefl", "flwr")]
    propagate = [lg.propagate for lg in loggers]
    for lg in loggers:
        lg.propagate = False
        for handler in files:
            lg.addHandler(handler)
    try:
        yield
    finally:
        for lg, was in zip(loggers, propagate, strict=True):
            lg.propagate = was
            for handler in files:
                lg.removeHandler(handler)


def write_sweep_summary(sweep_dir: Path) -> list[Path]:
    """Summarise every job folder under ``sweep_dir`` into CSV, markdown and PNG files there."""
    rows = [job_row(sweep_dir, d) for d in job_dirs(sweep_dir)]
    return [
        write_summary_csv(rows, sweep_dir / SUMMARY_CSV),
        write_summary_md(rows, sweep_dir / SUMMARY_MD),
        plot_sweep(rows, sweep_dir / SUMMARY_PNG),
    ]


class SweepSummary(Callback):
    """Hydra callback (``hydra.callbacks`` in conf/config.yaml): the summary after the last job."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        """Write the sweep summary into the sweep folder."""
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        paths = write_sweep_summary(sweep_dir)
        logger.info("sweep summary in %s: %s", sweep_dir, ", ".join(p.name for p in paths))
