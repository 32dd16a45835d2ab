"""Sweep summary rows: one per job folder of a multirun, read from its files; CSV and markdown."""

import csv
import dataclasses
import json
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from edgefl.config import conf_dir
from edgefl.results import CENTRAL_ACC_NAME, ROUNDS_JSON
from vtensor import format_bytes

STATUS_JSON = "job_status.json"
SUMMARY_CSV, SUMMARY_MD = "sweep_summary.csv", "sweep_summary.md"
_HYDRA_DIR = ".hydra"  # Hydra writes it into every job folder before the job starts


class JobState(StrEnum):
    """How a job ended, as the summary reports it."""

    OK = "ok"
    FAILED = "failed"  # the job caught its error and recorded it in job_status.json
    NO_RESULTS = "no results"  # no status and no rounds.json: killed, crashed or still running


@dataclass(frozen=True)
class JobStatus:
    """What a job records in its folder when it ends (job_status.json)."""

    state: JobState
    error: str  # "" when OK; else the exception's type and first line
    overrides: tuple[str, ...]
    wall_s: float


@dataclass(frozen=True)
class JobRow:
    """One job of a sweep; the fields up to ``output_dir`` are the summary's columns."""

    job: str  # job folder relative to the sweep folder (Hydra's job number by default)
    overrides: tuple[str, ...]
    status: JobState
    error: str
    comparable: bool  # False: a check, not a result (NOTE [checks, not results])
    final_central_acc: float | None
    final_central_loss: float | None
    rounds: int  # federated rounds completed (round 0 is the initial model's evaluation)
    mean_round_wall_s: float | None
    max_peak_fraction: float | None  # max over rounds and clients of peak-device-bytes / budget
    bytes_swapped: int | None  # out + in, summed over rounds and clients
    job_wall_s: float | None
    output_dir: str
    # per-round series for the plot, not columns: (round, accuracy) and (round >= 1, seconds)
    central_acc: tuple[tuple[int, float], ...] = field(default=(), metadata={"column": False})
    round_wall_s: tuple[tuple[int, float], ...] = field(default=(), metadata={"column": False})
    check: str = field(default="", metadata={"column": False})  # why not comparable
    accuracy: str = field(default="accuracy", metadata={"column": False})  # what acc counts


COLUMNS = tuple(f.name for f in dataclasses.fields(JobRow) if f.metadata.get("column", True))
_NO_FIGURES: dict[str, Any] = {
    "final_central_acc": None,
    "final_central_loss": None,
    "rounds": 0,
    "mean_round_wall_s": None,
    "max_peak_fraction": None,
    "bytes_swapped": None,
}


def write_job_status(job_dir: Path, status: JobStatus) -> Path:
    """Record how a job ended in its folder."""
    path = job_dir / STATUS_JSON
    path.write_text(json.dumps({**dataclasses.asdict(status), "state": str(status.state)}) + "\n")
    return path


def read_job_status(job_dir: Path) -> JobStatus | None:
    """The job's recorded status, or None if it recorded none."""
    path = job_dir / STATUS_JSON
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    return JobStatus(
        JobState(raw["state"]), str(raw["error"]), tuple(raw["overrides"]), float(raw["wall_s"])
    )


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The job folders under ``sweep_dir`` (those Hydra wrote a .hydra folder into), in order."""
    found = [p.parent for p in sweep_dir.glob(f"**/{_HYDRA_DIR}") if p.is_dir()]

    def key(path: Path) -> list[tuple[int, int, str]]:  # job 10 after job 9
        return [(0, int(s), "") if s.isdigit() else (1, 0, s) for s in path.parts]

    return sorted(found, key=lambda p: key(p.relative_to(sweep_dir)))


def job_row(sweep_dir: Path, job_dir: Path) -> JobRow:
    """Summarise one job folder; a folder without results gives a row that says so."""
    status = read_job_status(job_dir)
    overrides = status.overrides if status else _hydra_overrides(job_dir)
    state = status.state if status else JobState.OK
    error = status.error if status else ""
    check = check_reason(_hydra_choices(job_dir, overrides))
    base: dict[str, Any] = {
        "job": str(job_dir.relative_to(sweep_dir)),
        "overrides": overrides,
        "comparable": not check,
        "check": check,
        "job_wall_s": status.wall_s if status else None,
        "output_dir": str(job_dir),
    }
    try:
        results = json.loads((job_dir / ROUNDS_JSON).read_text())
        rounds = results["rounds"]
    except FileNotFoundError:
        if state is JobState.OK:  # no status either, or a status that claims results
            state = JobState.NO_RESULTS
            error = error or f"no {STATUS_JSON} and no {ROUNDS_JSON}"
        return JobRow(**base, **_NO_FIGURES, status=state, error=error)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        error = error or f"unreadable {ROUNDS_JSON}: {exc!r}"
        return JobRow(**base, **_NO_FIGURES, status=JobState.NO_RESULTS, error=error)
    accuracy = str(results.get(CENTRAL_ACC_NAME, "accuracy"))
    return JobRow(**base, status=state, error=error, accuracy=accuracy, **_round_figures(rounds))


def _round_figures(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's figures from rounds.json's rows (edgefl.history.RoundRecord fields)."""
    evaluated = [r for r in rounds if r["central_acc"] is not None]
    trained = [r for r in rounds if r["server_round"] >= 1]
    fractions = [r["max_peak_fraction"] for r in trained if r["max_peak_fraction"] is not None]
    last = evaluated[-1] if evaluated else None
    return {
        "final_central_acc": last["central_acc"] if last else None,
        "final_central_loss": last["central_loss"] if last else None,
        "rounds": len(trained),
        "mean_round_wall_s": statistics.fmean(r["wall_s"] for r in trained) if trained else None,
        "max_peak_fraction": max(fractions) if fractions else None,
        "bytes_swapped": sum(int(r["bytes_swapped"]) for r in trained),
        "central_acc": tuple((int(r["server_round"]), r["central_acc"]) for r in evaluated),
        "round_wall_s": tuple((int(r["server_round"]), r["wall_s"]) for r in trained),
    }


# NOTE [checks, not results]: a debug preset that sets more than logging (debug=fast: 2 rounds
# on a sliver of the data) and the smoke experiment check that a configuration runs; they do not
# train long enough for their figures to compare with full runs' or to tell jobs apart. The
# summary marks such jobs by the presets Hydra recorded for them, and says why.
_LOGGING_KEYS = ("simulation", "hydra")  # what a debug preset may set and still give results
_CHECK_EXPERIMENTS = ("smoke",)


def check_reason(choices: Mapping[str, str]) -> str:
    """Why a job with these config group ``choices`` is a check, not a result; "" if it is not."""
    experiment = choices.get("experiment", "none")
    if experiment in _CHECK_EXPERIMENTS:
        return f"experiment={experiment} (a check on a sliver of the data, not a result)"
    debug = choices.get("debug", "none")
    if debug == "none":
        return ""
    path = conf_dir() / "debug" / f"{debug}.yaml"
    if not path.is_file():
        return f"debug={debug} (a preset no longer in {path.parent}: cannot tell what it changed)"
    preset = OmegaConf.load(path)
    keys = _keys(preset) if isinstance(preset, DictConfig) else []
    changed = [k for k in keys if k.split(".")[0] not in _LOGGING_KEYS]
    if not changed:
        return ""
    return f"debug={debug} sets {', '.join(changed)} (a check, not a result)"


def _keys(node: DictConfig, prefix: str = "") -> list[str]:
    """The dotted keys a config file sets (its leaves), ``defaults`` left out."""
    keys = []
    for name, value in node.items():
        key = f"{prefix}{name!s}"
        if isinstance(value, DictConfig) and value:
            keys += _keys(value, f"{key}.")
        elif key != "defaults":
            keys.append(key)
    return keys


def _hydra_choices(job_dir: Path, overrides: tuple[str, ...]) -> dict[str, str]:
    """The job's config group choices: Hydra's record, else its ``group=option`` overrides."""
    path = job_dir / _HYDRA_DIR / "hydra.yaml"
    if path.is_file():
        choices = OmegaConf.select(OmegaConf.load(path), "hydra.runtime.choices", default=None)
        if isinstance(choices, DictConfig):
            return {str(k): str(v) for k, v in choices.items()}
    return dict(o.split("=", 1) for o in overrides if "=" in o and "." not in o.split("=")[0])


def _hydra_overrides(job_dir: Path) -> tuple[str, ...]:
    path = job_dir / _HYDRA_DIR / "overrides.yaml"
    if not path.is_file():
        return ()
    return tuple(str(o) for o in OmegaConf.load(path))


def write_summary_csv(rows: list[JobRow], path: Path) -> Path:
    """One row per job; empty cells where a job has no such figure."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for row in rows:
            values = [getattr(row, c) for c in COLUMNS]
            writer.writerow(["" if v is None else _plain(v) for v in values])
    return path


def write_summary_md(rows: list[JobRow], path: Path) -> Path:
    """The CSV's rows as a markdown table, figures rounded for reading."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [
            row.job,
            " ".join(row.overrides),
            str(row.status),
            row.error,
            "yes" if row.comparable else "no",
            _fmt(row.final_central_acc, "{:.4f}"),
            _fmt(row.final_central_loss, "{:.4f}"),
            str(row.rounds),
            _fmt(row.mean_round_wall_s, "{:.2f}"),
            _fmt(row.max_peak_fraction, "{:.1%}"),
            "-" if row.bytes_swapped is None else format_bytes(row.bytes_swapped),
            _fmt(row.job_wall_s, "{:.1f}"),
            row.output_dir,
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines += _check_lines(rows) + _accuracy_lines(rows)
    path.write_text("\n".join(lines) + "\n")
    return path


def _check_lines(rows: list[JobRow]) -> list[str]:
    """Below the table: the jobs that are checks, not results, grouped by why."""
    jobs: dict[str, list[str]] = {}
    for row in rows:
        if not row.comparable:
            jobs.setdefault(row.check, []).append(row.job)
    if not jobs:
        return []
    lines = [""]
    for why, names in jobs.items():
        which = f"jobs {', '.join(names)}" if len(names) > 1 else f"job {names[0]}"
        lines.append(f"Not comparable: {which}: {why}.")
    lines.append("Compare full runs only; the figures of the jobs marked comparable are results.")
    return lines


def _accuracy_lines(rows: list[JobRow]) -> list[str]:
    """Below the table: the jobs whose accuracy counts something other than labels."""
    jobs: dict[str, list[str]] = {}
    for row in rows:
        if row.accuracy != "accuracy":
            jobs.setdefault(row.accuracy, []).append(row.job)
    lines = [f"final_central_acc of job {', '.join(j)}: {name}." for name, j in jobs.items()]
    return ["", *lines] if lines else []


def _plain(value: object) -> object:
    return " ".join(value) if isinstance(value, tuple) else value


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|") or "-"
