"""The edgefl-sim entry point's cheap paths (no simulation engine)."""

import pytest

from edgefl.config import load_run_settings
from edgefl.errors import PartitionError
from edgefl.sim import main, prepare


def test_help_lists_every_group(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for group in ("dataset", "model", "fleet", "strategy", "vtensor", "experiment"):
        assert f"  {group}:" in out


def test_bad_config_fails_before_the_engine_starts() -> None:
    overrides = ["partitioner=natural", "output_dir=/tmp/edgefl-never-written"]
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
