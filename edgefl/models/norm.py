"""Normalisation layer of the zoo: GroupNorm.

BatchNorm's running statistics and integer batch counters do not average meaningfully across
clients, so the zoo uses GroupNorm everywhere.
"""

import math

from torch import nn


def group_norm(channels: int, max_groups: int = 8) -> nn.GroupNorm:
    """GroupNorm over ``channels``, groups = the largest divisor of it up to ``max_groups``."""
    return nn.GroupNorm(math.gcd(channels, max_groups), channels)
