"""Privacy settings: the typed, validated form of the ``privacy`` config group.

NOTE [privacy keys]: a ``conf/privacy/*.yaml`` option holds ``name`` (the mode) and exactly the
keys its mode uses, spelled as the PrivacySettings fields. A key of another mode is an error, not
ignored: ``privacy=local privacy.noise_multiplier=1`` would otherwise run without the noise the
user asked for.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from edgefl.errors import ConfigError


class PrivacyMode(StrEnum):
    """Which differential privacy a run has (the ``name`` of the privacy option)."""

    NONE = "none"
    CENTRAL_FIXED = "central-fixed"  # DP-FedAvg: clip each update to a fixed norm, noise the mean
    CENTRAL_ADAPTIVE = "central-adaptive"  # the same with a norm that tracks an update quantile
    LOCAL = "local"  # each client clips and noises its own update before sending it


class ClippingSide(StrEnum):
    """Where central DP clips the updates: on the clients or on the server."""

    CLIENT = "client"
    SERVER = "server"


@dataclass(frozen=True)
class PrivacySettings:
    """One privacy option; fields a mode does not use keep their defaults.

    ``noise_multiplier`` is the accounted per-round noise multiplier of the central modes (the
    adaptive mode splits it between the update and the clipped count, see
    ``edgefl.privacy.accounting``). ``clipping_norm`` is the L2 bound of a client's update
    (central-fixed, local) or its starting value (central-adaptive). ``delta`` is the delta at
    which epsilon is reported and, in local mode, the delta LocalDpMod calibrates its noise to.
    """

    mode: PrivacyMode = PrivacyMode.NONE
    clipping_side: ClippingSide = ClippingSide.CLIENT
    noise_multiplier: float = 0.0
    clipping_norm: float = 0.0
    target_clipped_quantile: float = 0.5
    clip_norm_lr: float = 0.2
    clipped_count_stddev: float = 0.0
    local_epsilon: float = 0.0
    local_sensitivity: float = 0.0
    delta: float = 1e-5
    target_epsilon: float | None = None  # None = report epsilon, never stop

    @property
    def central(self) -> bool:
        """Whether the server adds the noise (central-fixed or central-adaptive)."""
        return self.mode in (PrivacyMode.CENTRAL_FIXED, PrivacyMode.CENTRAL_ADAPTIVE)


_COMMON = ("delta", "target_epsilon")
MODE_KEYS: dict[PrivacyMode, tuple[str, ...]] = {
    PrivacyMode.NONE: (),
    PrivacyMode.CENTRAL_FIXED: ("clipping_side", "noise_multiplier", "clipping_norm", *_COMMON),
    PrivacyMode.CENTRAL_ADAPTIVE: (
        "clipping_side",
        "noise_multiplier",
        "clipping_norm",
        "target_clipped_quantile",
        "clip_norm_lr",
        "clipped_count_stddev",
        *_COMMON,
    ),
    PrivacyMode.LOCAL: ("clipping_norm", "local_epsilon", "local_sensitivity", *_COMMON),
}


def privacy_settings(raw: Mapping[str, Any]) -> PrivacySettings:
    """Convert the composed ``privacy`` group (a plain dict) into checked PrivacySettings."""
    mode = _mode(raw.get("name"))
    allowed = MODE_KEYS[mode]
    for key in raw:
        if key != "name" and key not in allowed:
            raise ConfigError(
                f"privacy.{key}={raw[key]!r} is not a setting of privacy mode {mode.value!r}; "
                f"remove it (that mode takes {list(allowed) or 'no keys'})"
            )
    missing = [key for key in allowed if key not in raw]
    if missing:
        raise ConfigError(f"privacy mode {mode.value!r} needs privacy.{missing[0]}; set it")
    if mode is PrivacyMode.NONE:
        return PrivacySettings()
    values: dict[str, Any] = {"mode": mode, "delta": _probability(raw, "delta")}
    target = raw["target_epsilon"]
    values["target_epsilon"] = None if target is None else _positive(raw, "target_epsilon")
    if mode is PrivacyMode.LOCAL:
        for key in ("clipping_norm", "local_epsilon", "local_sensitivity"):
            values[key] = _positive(raw, key)
        return PrivacySettings(**values)
    return PrivacySettings(**values, **_central(raw, mode))


def _central(raw: Mapping[str, Any], mode: PrivacyMode) -> dict[str, Any]:
    values: dict[str, Any] = {
        "clipping_side": _side(raw["clipping_side"]),
        "noise_multiplier": _positive(raw, "noise_multiplier"),
        "clipping_norm": _positive(raw, "clipping_norm"),
    }
    if mode is PrivacyMode.CENTRAL_ADAPTIVE:
        values["target_clipped_quantile"] = _probability(raw, "target_clipped_quantile")
        values["clip_norm_lr"] = _positive(raw, "clip_norm_lr")
        values["clipped_count_stddev"] = _positive(raw, "clipped_count_stddev")
        if values["clipped_count_stddev"] <= values["noise_multiplier"]:
            # NOTE [adaptive noise split] in edgefl.privacy.accounting: the count's share of the
            # per-round budget is 1/clipped_count_stddev^2, which must leave room for the update.
            raise ConfigError(
                f"privacy.clipped_count_stddev={values['clipped_count_stddev']} must exceed "
                f"privacy.noise_multiplier={values['noise_multiplier']}: the noisy clipped count "
                "spends part of each round's privacy; raise clipped_count_stddev (e.g. to "
                "2.5 * noise_multiplier) or lower noise_multiplier"
            )
    return values


def _mode(name: Any) -> PrivacyMode:
    try:
        return PrivacyMode(name)
    except ValueError:
        raise ConfigError(
            f"privacy.name={name!r} is not a privacy mode; choose one of "
            f"{[m.value for m in PrivacyMode]} (the options in conf/privacy/)"
        ) from None


def _side(value: Any) -> ClippingSide:
    try:
        return ClippingSide(value)
    except ValueError:
        raise ConfigError(
            f"privacy.clipping_side={value!r} is not a clipping side; choose "
            f"{[s.value for s in ClippingSide]}"
        ) from None


def _number(raw: Mapping[str, Any], key: str) -> float:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"privacy.{key}={value!r} must be a finite number")
    return float(value)


def _positive(raw: Mapping[str, Any], key: str) -> float:
    value = _number(raw, key)
    if value <= 0:
        raise ConfigError(f"privacy.{key}={raw[key]!r} must be greater than 0")
    return value


def _probability(raw: Mapping[str, Any], key: str) -> float:
    value = _number(raw, key)
    if not 0 < value < 1:
        raise ConfigError(f"privacy.{key}={raw[key]!r} must lie strictly between 0 and 1")
    return value


def check_secure_aggregation(privacy: PrivacySettings) -> None:
    """Raise ConfigError if ``privacy`` cannot run under secure aggregation (docs/privacy.md).

    Secure aggregation shows the server only the sum of the updates, so the server cannot clip
    them one by one; client-side clipping (central modes) and local DP compose with it.
    """
    if privacy.central and privacy.clipping_side is ClippingSide.SERVER:
        raise ConfigError(
            f"privacy={privacy.mode.value} with privacy.clipping_side=server needs each "
            "client's update, which secure aggregation hides from the server; set "
            "privacy.clipping_side=client or turn secure aggregation off"
        )
