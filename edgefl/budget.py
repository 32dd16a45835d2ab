"""Memory budgets of devices: absolute bytes, or a fraction of the model's unmanaged peak.

NOTE [relative budgets]: a budget such as ``"80%"`` means 80 % of the unmanaged training peak
of this model and batch size, measured by the client itself with vtensor's accounting (once per
process, see ``edgefl.peak.resolve_budget``). It keeps a simulated fleet below the unmanaged peak
(so it needs vtensor) on any model, and it follows vtensor's own accounting of this process.
"""

from dataclasses import dataclass
from typing import Any

import vtensor
from edgefl.errors import ConfigError


@dataclass(frozen=True)
class Budget:
    """Exactly one of ``bytes`` (> 0) or ``peak_fraction`` (in (0, 1]) is set."""

    bytes: int = 0
    peak_fraction: float = 0.0

    def __post_init__(self) -> None:
        if (self.bytes > 0) == (self.peak_fraction > 0) or self.peak_fraction > 1:
            raise ConfigError(f"budget {self!r} must be a byte size or a percentage in (0, 100]")

    def of_peak(self, peak_bytes: int) -> int:
        """The bytes this budget stands for where the unmanaged peak is ``peak_bytes``."""
        return self.bytes or max(1, int(self.peak_fraction * peak_bytes))

    def __str__(self) -> str:
        if self.bytes:
            return vtensor.format_bytes(self.bytes)
        return f"{100 * self.peak_fraction:g}% of the unmanaged peak"


def parse_budget(value: Any, what: str) -> Budget:
    """``"80%"`` -> fraction of the unmanaged peak; ``"64MiB"``, ``67108864`` -> bytes."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            percent = float(value.strip()[:-1])
        except ValueError:
            raise ConfigError(f"{what}={value!r} is not a percentage such as '80%'") from None
        if not 0 < percent <= 100:
            raise ConfigError(f"{what}={value!r} must be a percentage in (0, 100]")
        return Budget(peak_fraction=percent / 100)
    try:
        return Budget(bytes=vtensor.parse_bytes(value, what=what))
    except vtensor.VTensorError as exc:
        raise ConfigError(f"{exc}, or a percentage of the unmanaged peak such as '80%'") from exc
