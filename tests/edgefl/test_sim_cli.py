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
