"""Hydra multirun sweeps of simulations and their summary (``edgefl-sim -m ...``)."""

from edgefl.sweep.multirun import SweepSummary, is_multirun, run_multirun, write_sweep_summary
from edgefl.sweep.plot import SUMMARY_PNG
from edgefl.sweep.summary import STATUS_JSON, SUMMARY_CSV, SUMMARY_MD, JobState

__all__ = [
    "STATUS_JSON",
    "SUMMARY_CSV",
    "SUMMARY_MD",
    "SUMMARY_PNG",
    "JobState",
    "SweepSummary",
    "is_multirun",
    "run_multirun",
    "write_sweep_summary",
]
