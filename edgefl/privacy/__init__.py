"""Differential privacy for edgefl: settings, strategy wrappers, client mods and the budget guard.

See docs/privacy.md for what each mode guarantees and how it combines with secure aggregation.
"""

from edgefl.privacy.accounting import epsilon_after, local_noise_stdev, round_noise_multiplier
from edgefl.privacy.adaptive import AdaptiveClipping
from edgefl.privacy.guard import PrivacyBudgetExhausted, PrivacyGuard
from edgefl.privacy.mods import (
    CLIPPING_NORM_KEY,
    NORM_BIT_KEY,
    UNIT_WEIGHT_KEY,
    client_evaluate_mods,
    client_train_mods,
    evaluate_metric_keys,
    evaluate_privacy_mod,
    train_config_keys,
    train_metric_keys,
    train_privacy_mod,
    unit_weight_mod,
)
from edgefl.privacy.settings import (
    ClippingSide,
    PrivacyMode,
    PrivacySettings,
    check_secure_aggregation,
    privacy_settings,
)
from edgefl.privacy.strategy import num_sampled_clients, wrap_strategy

__all__ = [
    "CLIPPING_NORM_KEY",
    "NORM_BIT_KEY",
    "UNIT_WEIGHT_KEY",
    "AdaptiveClipping",
    "ClippingSide",
    "PrivacyBudgetExhausted",
    "PrivacyGuard",
    "PrivacyMode",
    "PrivacySettings",
    "check_secure_aggregation",
    "client_evaluate_mods",
    "client_train_mods",
    "epsilon_after",
    "evaluate_metric_keys",
    "evaluate_privacy_mod",
    "local_noise_stdev",
    "num_sampled_clients",
    "privacy_settings",
    "round_noise_multiplier",
    "train_config_keys",
    "train_metric_keys",
    "train_privacy_mod",
    "unit_weight_mod",
    "wrap_strategy",
]
