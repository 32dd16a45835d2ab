"""Logging setup: the project's lines shown, exactly Flower's two noise records dropped."""

import logging

import pytest

from edgefl.log_setup import configure_logging


def test_flower_noise_is_dropped_and_other_flower_warnings_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    configure_logging()
    flower = logging.getLogger("flwr")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        flower.warning(
            "DEPRECATED FEATURE: %s",
            "The `run_simulation` function is deprecated and will be removed",
        )
        flower.warning("Manually terminating %s", "ClientAppActor")
        flower.warning("Something else: %s", "kept")
    messages = [r.getMessage() for r in caplog.records if r.name == "flwr"]
    assert messages == ["Something else: kept"]
    assert flower.level == logging.WARNING  # Flower's INFO lines (mods, sampling) hidden
