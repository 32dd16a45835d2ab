"""Hydra multirun sweeps: real sweeps on the simulation engine, and the sweep summary writer."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgefl.history import RoundRecord, RunHistory
from edgefl.results import (
    CENTRAL_ACC_NAME,
    CLIENTS_CSV,
    ROUNDS_CSV,
    ROUNDS_JSON,
    SETTINGS_JSON,
    SUMMARY_TXT,
    write_results,
)
from edgefl.settings import RunSettings
from edgefl.sweep import (
    STATUS_JSON,
    SUMMARY_CSV,
    SUMMARY_MD,
    SUMMARY_PNG,
    JobState,
    write_sweep_summary,
)
from edgefl.sweep.__main__ import main as summary_main
from edgefl.sweep.summary import JobStatus, write_job_status

SMOKE = "experiment=smoke"  # 2 clients, 1 round, a narrow CNN on a sliver of MNIST
PNG_MAGIC = b"\x89PNG"


def _sweep(sweep_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """``python -m edgefl.sim -m OVERRIDES`` into ``sweep_dir``, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "edgefl.sim", "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"],
        cwd=sweep_dir.parent,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )


def _summary_rows(sweep_dir: Path) -> list[dict[str, str]]:
    with (sweep_dir / SUMMARY_CSV).open(newline="") as f:
        return list(csv.DictReader(f))


def _md_rows(sweep_dir: Path) -> list[str]:
    lines = (sweep_dir / SUMMARY_MD).read_text().splitlines()[2:]  # past header and rule
    return [line for line in lines if line.startswith("|")]  # the notes below are no rows


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    sweep_dir = tmp_path_factory.mktemp("sweep-ok") / "sweep"
    done = _sweep(sweep_dir, SMOKE, "strategy=fedavg,fedprox")
    return sweep_dir, done.returncode, done.stderr


@pytest.fixture(scope="module")
def one_fails(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """MNIST has no natural ids: partitioner=natural composes, then fails when the job runs."""
    sweep_dir = tmp_path_factory.mktemp("sweep-fail") / "sweep"
    done = _sweep(sweep_dir, SMOKE, "partitioner=natural,iid")
    return sweep_dir, done.returncode, done.stderr


@pytest.mark.slow
def test_sweep_runs_each_job_into_its_folder_and_summarises(
    two_jobs: tuple[Path, int, str],
) -> None:
    sweep_dir, returncode, stderr = two_jobs
    assert returncode == 0, stderr[-3000:]
    for job, strategy in (("0", "fedavg"), ("1", "fedprox")):
        job_dir = sweep_dir / job
        for name in (ROUNDS_JSON, ROUNDS_CSV, CLIENTS_CSV, SUMMARY_TXT, STATUS_JSON):
            assert (job_dir / name).is_file(), f"{job_dir / name} missing"
        settings = json.loads((job_dir / SETTINGS_JSON).read_text())
        assert settings["server"]["output_dir"] == str(job_dir.resolve())
        assert strategy in settings["server"]["strategy"]["target"].lower()
        assert json.loads((job_dir / STATUS_JSON).read_text())["state"] == "ok"
        log = (job_dir / "edgefl-sim.log").read_text()  # edgefl's lines reach Hydra's job log
        assert "round 1/1:" in log and "edgefl.server_app" in log
    rows = _summary_rows(sweep_dir)
    assert [r["overrides"] for r in rows] == [
        f"{SMOKE} strategy=fedavg",
        f"{SMOKE} strategy=fedprox",
    ]
    for row in rows:
        assert (row["status"], row["error"], row["rounds"]) == ("ok", "", "1")
        assert 0.0 <= float(row["final_central_acc"]) <= 1.0
        assert float(row["mean_round_wall_s"]) > 0
        assert 0.0 < float(row["max_peak_fraction"]) <= 1.0
    assert len(_md_rows(sweep_dir)) == 2
    assert (sweep_dir / SUMMARY_PNG).read_bytes().startswith(PNG_MAGIC)


@pytest.mark.slow
def test_failed_job_is_reported_and_the_others_still_run(one_fails: tuple[Path, int, str]) -> None:
    sweep_dir, returncode, stderr = one_fails
    assert returncode == 1, stderr[-3000:]
    status = json.loads((sweep_dir / "0" / STATUS_JSON).read_text())
    assert status["state"] == "failed"
    assert status["error"].startswith("PartitionError: partitioner 'natural'")
    assert not (sweep_dir / "0" / ROUNDS_JSON).exists()
    assert (sweep_dir / "1" / ROUNDS_JSON).is_file()  # the job after the failure ran
    failed, ok = _summary_rows(sweep_dir)
    assert (failed["status"], failed["rounds"], failed["final_central_acc"]) == ("failed", "0", "")
    assert failed["error"] == status["error"]
    assert (ok["status"], ok["rounds"]) == ("ok", "1")
    assert "| failed | PartitionError" in _md_rows(sweep_dir)[0]
    assert (sweep_dir / SUMMARY_PNG).read_bytes().startswith(PNG_MAGIC)


@pytest.mark.slow
def test_sweep_whose_overrides_do_not_compose_does_not_start(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    done = _sweep(sweep_dir, SMOKE, "model=cnn,no_such_model")
    assert done.returncode == 2
    assert "no_such_model" in done.stderr
    assert not (sweep_dir / "0").exists()  # Hydra checks every job's config before the first


def _round(server_round: int, acc: float, fraction: float | None, swapped: int) -> RoundRecord:
    return RoundRecord(
        server_round=server_round,
        central_loss=2.0 - acc,
        central_acc=acc,
        clients_trained=2 if server_round else 0,
        clients_failed=0,
        train_loss=None,
        max_peak_fraction=fraction,
        bytes_swapped=swapped,
        stall_s=0.0,
        local_acc=None,
        wall_s=0.5 * (server_round + 1),
    )


def _job_dir(sweep_dir: Path, name: str, *overrides: str) -> Path:
    job_dir = sweep_dir / name
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    return job_dir


def test_summary_of_ok_failed_and_silent_job_folders(
    tmp_path: Path, smoke_settings: RunSettings
) -> None:
    ok = _job_dir(tmp_path, "0", "seed=1")
    history = RunHistory(
        rounds=[_round(0, 0.1, None, 0), _round(1, 0.5, 0.75, 100), _round(2, 0.6, 0.9, 50)]
    )
    write_results(ok, history, {"w": torch.zeros(1)}, smoke_settings, {})
    write_job_status(ok, JobStatus(JobState.OK, "", ("seed=1",), 3.0))
    failed = _job_dir(tmp_path, "1", "seed=2")
    write_job_status(failed, JobStatus(JobState.FAILED, "ValueError: a | b", ("seed=2",), 1.0))
    _job_dir(tmp_path, "10", "seed=4")  # killed before it recorded anything: sorts after 2
    _job_dir(tmp_path, "2", "seed=3")

    paths = write_sweep_summary(tmp_path)

    assert paths == [tmp_path / SUMMARY_CSV, tmp_path / SUMMARY_MD, tmp_path / SUMMARY_PNG]
    rows = _summary_rows(tmp_path)
    assert [(r["job"], r["overrides"], r["status"]) for r in rows] == [
        ("0", "seed=1", "ok"),
        ("1", "seed=2", "failed"),
        ("2", "seed=3", "no results"),
        ("10", "seed=4", "no results"),
    ]
    first = rows[0]
    assert float(first["final_central_acc"]) == pytest.approx(0.6)
    assert float(first["final_central_loss"]) == pytest.approx(1.4)
    assert first["rounds"] == "2"
    assert float(first["mean_round_wall_s"]) == pytest.approx(1.25)  # rounds 1 and 2 only
    assert float(first["max_peak_fraction"]) == pytest.approx(0.9)
    assert first["bytes_swapped"] == "150"
    assert first["output_dir"] == str(ok)
    assert rows[1]["error"] == "ValueError: a | b"
    assert rows[1]["final_central_acc"] == rows[1]["bytes_swapped"] == ""
    assert "no job_status.json" in rows[2]["error"]
    md = _md_rows(tmp_path)
    assert len(md) == 4
    assert "| 0 | seed=1 | ok | - | yes | 0.6000 | 1.4000 | 2 | 1.25 | 90.0% |" in md[0]
    assert "ValueError: a \\| b" in md[1]  # a pipe in an error does not split the cell
    assert (tmp_path / SUMMARY_PNG).read_bytes().startswith(PNG_MAGIC)


def test_summary_marks_debug_fast_jobs_as_not_comparable(
    tmp_path: Path, smoke_settings: RunSettings
) -> None:
    """A debug preset that shrinks the run makes a check; one that only logs more does not."""
    history = RunHistory(rounds=[_round(0, 0.1, None, 0), _round(1, 0.5, 0.75, 100)])
    for job, debug in (("0", "fast"), ("1", "verbose"), ("2", "fast")):
        job_dir = _job_dir(tmp_path, job, f"debug={debug}")
        choices = (
            f"hydra:\n  runtime:\n    choices:\n      debug: {debug}\n      experiment: none\n"
        )
        (job_dir / ".hydra" / "hydra.yaml").write_text(choices)
        write_results(job_dir, history, {"w": torch.zeros(1)}, smoke_settings, {})
        write_job_status(job_dir, JobStatus(JobState.OK, "", (f"debug={debug}",), 1.0))

    write_sweep_summary(tmp_path)

    assert [r["comparable"] for r in _summary_rows(tmp_path)] == ["False", "True", "False"]
    md = (tmp_path / SUMMARY_MD).read_text().splitlines()
    assert md[0].split(" | ")[4] == "comparable"
    assert [row.split(" | ")[4] for row in md[2:5]] == ["no", "yes", "no"]
    notes = [line for line in md if line.startswith("Not comparable")]
    assert len(notes) == 1 and notes[0].startswith("Not comparable: jobs 0, 2: debug=fast sets ")
    assert "num_rounds" in notes[0] and "dataset.max_examples_per_client" in notes[0]


def test_summary_names_a_text_jobs_accuracy(tmp_path: Path, smoke_settings: RunSettings) -> None:
    history = RunHistory(rounds=[_round(0, 0.1, None, 0), _round(1, 0.5, 0.75, 100)])
    for job, accuracy in (("0", "accuracy"), ("1", "next-character accuracy")):
        job_dir = _job_dir(tmp_path, job, f"seed={job}")
        extra = {CENTRAL_ACC_NAME: accuracy}
        write_results(job_dir, history, {"w": torch.zeros(1)}, smoke_settings, extra)
    write_sweep_summary(tmp_path)
    md = (tmp_path / SUMMARY_MD).read_text()
    assert md.endswith("\nfinal_central_acc of job 1: next-character accuracy.\n")


def test_summary_command_rewrites_a_sweep_folder(tmp_path: Path) -> None:
    job_dir = _job_dir(tmp_path, "0", "seed=1")
    write_job_status(job_dir, JobStatus(JobState.FAILED, "KeyboardInterrupt", ("seed=1",), 1.0))
    assert summary_main([str(tmp_path)]) == 2  # not a sweep folder: Hydra's multirun.yaml missing
    assert not (tmp_path / SUMMARY_CSV).exists()
    (tmp_path / "multirun.yaml").write_text("{}\n")
    assert summary_main([str(tmp_path)]) == 0
    assert [r["status"] for r in _summary_rows(tmp_path)] == ["failed"]
