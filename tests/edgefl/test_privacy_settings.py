"""Differential privacy settings: every option converts, bad values are refused with the fix."""

from typing import Any, cast

import pytest
from omegaconf import OmegaConf
from privacy_messages import ADAPTIVE, FIXED, LOCAL

from edgefl.config import compose_config, group_options
from edgefl.errors import ConfigError
from edgefl.privacy import PrivacyMode, PrivacySettings, check_secure_aggregation, privacy_settings


@pytest.mark.parametrize("option", group_options("privacy"))
def test_privacy_settings_every_option_converts(option: str) -> None:
    raw = OmegaConf.to_container(compose_config([f"privacy={option}"]).privacy, resolve=True)
    assert isinstance(raw, dict)
    settings = privacy_settings(cast(dict[str, Any], raw))
    assert settings.mode is PrivacyMode(option.replace("_", "-"))
    assert settings.delta == 1e-5


@pytest.mark.parametrize(
    "raw, words",
    [
        ({**FIXED, "name": "central"}, ["privacy.name='central'", "central-fixed"]),
        ({**FIXED, "local_epsilon": 3.0}, ["privacy.local_epsilon=3.0", "remove it"]),
        ({k: v for k, v in FIXED.items() if k != "clipping_norm"}, ["privacy.clipping_norm"]),
        ({**FIXED, "noise_multiplier": -1.0}, ["privacy.noise_multiplier=-1.0", "greater than 0"]),
        ({**FIXED, "noise_multiplier": True}, ["privacy.noise_multiplier=True", "number"]),
        ({**FIXED, "delta": 1.5}, ["privacy.delta=1.5", "between 0 and 1"]),
        ({**FIXED, "clipping_side": "both"}, ["privacy.clipping_side='both'", "'client'"]),
        ({**FIXED, "target_epsilon": 0}, ["privacy.target_epsilon=0", "greater than 0"]),
        ({**ADAPTIVE, "clipped_count_stddev": 0.5}, ["clipped_count_stddev=0.5", "raise"]),
        ({**LOCAL, "local_epsilon": "ten"}, ["privacy.local_epsilon='ten'", "number"]),
    ],
)
def test_privacy_settings_reject_bad_values(raw: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        privacy_settings(raw)
    assert all(word in str(info.value) for word in words), str(info.value)


def test_privacy_settings_keep_the_values() -> None:
    settings = privacy_settings({**ADAPTIVE, "target_epsilon": 8})
    assert settings.mode is PrivacyMode.CENTRAL_ADAPTIVE and settings.central
    assert (settings.noise_multiplier, settings.clipped_count_stddev) == (1.0, 2.0)
    assert settings.target_epsilon == 8.0
    assert privacy_settings({"name": "none"}) == PrivacySettings()


def test_secure_aggregation_needs_client_side_clipping() -> None:
    with pytest.raises(ConfigError, match="clipping_side=client"):
        check_secure_aggregation(privacy_settings(FIXED))
    for raw in ({**FIXED, "clipping_side": "client"}, ADAPTIVE, LOCAL, {"name": "none"}):
        check_secure_aggregation(privacy_settings(raw))
