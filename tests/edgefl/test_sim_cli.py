"""The edgefl-sim entry point's cheap paths (no simulation engine)."""

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import flwr.simulation
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from edgefl import sim
from edgefl.budget import Budget
from edgefl.config import load_run_settings
from edgefl.data import load_dataset
from edgefl.errors import ConfigError, EdgeFLError, PartitionError
from edgefl.models import build_model
from edgefl.peak import PeakMeasurement
from edgefl.records import BUDGET_BYTES
from edgefl.reference import ReferenceRound
from edgefl.settings import DeviceClass, RunSettings
from edgefl.sim import main, prepare, simulate


def test_help_lists_every_group(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for group in ("dataset", "model", "fleet", "strategy", "vtensor", "experiment"):
        assert f"  {group}:" in out


def test_bad_config_fails_before_the_engine_starts(tmp_path: Path) -> None:
    overrides = ["partitioner=natural", f"output_dir={tmp_path / 'run'}"]
    with pytest.raises(PartitionError, match="iid or dirichlet"):  # MNIST has no natural ids
        prepare(load_run_settings(overrides))
    assert main(overrides) == 2


def test_cfg_job_prints_the_composed_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cfg", "job", "num_rounds=3"]) == 0
    out = capsys.readouterr().out
    assert "num_rounds: 3\n" in out and "hydra:" not in out


def test_cfg_hydra_and_info_describe_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cfg", "hydra"]) == 0
    assert "sweep:" in capsys.readouterr().out
    assert main(["--info", "experiment=hapt"]) == 0
    out = capsys.readouterr().out
    assert "config folder:" in out and "  model: sensor_cnn;" in out


def test_cfg_with_an_unknown_part_is_a_usage_error() -> None:
    assert main(["--cfg", "everything"]) == 2


def test_a_bad_class_budget_is_a_usage_error() -> None:
    assert main(["fleet.classes.micro.budget=abc"]) == 2  # the message: test_config.py


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_unwritable_output_dir_fails_in_one_line_before_anything_starts(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "edgefl.sim", "output_dir=/proc/x", "debug=fast"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,  # it fails before any engine starts, in seconds
    )
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "output_dir=/proc/x: cannot write there" in errors[0]
    assert "choose a writable folder" in errors[0]
    assert "Traceback" not in done.stderr and "Ray instance" not in done.stderr
    assert len(done.stderr.splitlines()) <= 3


def test_the_output_dir_is_checked_first(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    settings = load_run_settings([f"output_dir={blocked / 'run'}", "partitioner=natural"])
    with pytest.raises(ConfigError, match=r"output_dir=.*a-file/run: cannot write there"):
        prepare(settings)  # before the partitioner's error: nothing else is done first
    writable = tmp_path / "new" / "run"
    prepare(load_run_settings([f"output_dir={writable}", "debug=fast"]))
    assert writable.is_dir() and not any(writable.iterdir())  # the probe is gone


def test_simulated_clients_resolve_relative_budgets_by_the_runs_own_peak(
    smoke_settings: RunSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peak the run measured and logged sizes its clients' budgets, not one they measure.

    The peak given is 8 MiB, far from what a client would measure for the smoke model.
    """
    half = DeviceClass("half", Budget(peak_fraction=0.5), 1.0)
    fleet = dataclasses.replace(smoke_settings.client.fleet, classes=(half,))
    settings = dataclasses.replace(
        smoke_settings, client=dataclasses.replace(smoke_settings.client, fleet=fleet)
    )
    engine: dict[str, Any] = {}
    monkeypatch.setattr(flwr.simulation, "run_simulation", lambda **kw: engine.update(kw))
    peak = PeakMeasurement(unmanaged_peak_bytes=8 << 20, min_budget_bytes=1)
    with pytest.raises(EdgeFLError, match="without results"):  # no ServerApp ran
        simulate(settings, peak=peak, reference=ReferenceRound(1.0, 1))
    info = load_dataset(settings.client.data.name).info
    model = build_model(settings.client.model.name, info, settings.client.model.options)
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "config": ConfigRecord({"server-round": 1, "lr": 0.05}),
        }
    )
    node = {"partition-id": 0, "num-partitions": 2}
    context = Context(run_id=1, node_id=7, node_config=node, state=RecordDict(), run_config={})
    torch.manual_seed(0)
    reply = engine["client_app"](
        Message(content, dst_node_id=7, message_type=MessageType.TRAIN), context
    )
    assert not reply.has_error()
    assert reply.content["metrics"][BUDGET_BYTES] == half.budget.of_peak(8 << 20)


def test_the_results_line_names_the_files_the_run_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The printed listing is the ServerApp's (its log line's), not a list of its own."""
    written = [tmp_path / name for name in ("rounds.json", "settings.json", "summary.txt")]
    outcome = {"output_dir": tmp_path, "result_files": written}
    monkeypatch.setattr(sim, "prepare", lambda settings: settings)
    monkeypatch.setattr(sim, "measure_peak", lambda settings: None)
    monkeypatch.setattr(sim, "time_reference", lambda settings: None)
    monkeypatch.setattr(sim, "simulate", lambda settings, **kw: outcome)
    assert main([f"output_dir={tmp_path}"]) == 0
    assert (
        capsys.readouterr().out
        == f"results: {tmp_path} (rounds.json, settings.json, summary.txt)\n"
    )
