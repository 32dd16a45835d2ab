"""Memory budgets of devices: absolute bytes, or a fraction of the model's unmanaged peak.

NOTE [relative budgets]: a budget such as ``"80%"`` means 80 % of the unmanaged training peak
of this model and batch size, measured with vtensor's accounting. It keeps a simulated fleet
below the unmanaged peak (so it needs vtensor) on any model. A simulation (``edgefl.sim``)
measures the peak once, in its quiet process before any client starts, logs the budgets it
resolves from it and gives its clients those bytes (``edgefl.fleet.fleet_in_bytes``): the log,
the clients and the end table state one budget, the run's own. Elsewhere (``flwr run``, a
deployed node) a client measures the peak itself, once per process
(``edgefl.peak.resolve_budget``).

NOTE [budget quantum]: two processes measure the same model's peak a few KiB apart (vtensor's
heap counter sees every allocation of the process), and vtensor keys its plan cache by the budget
in bytes. Taken exactly, a relative budget would differ from one process to the next: the clients
of one device class would each make their own plan instead of sharing one, and a plan cache kept
from an earlier run would never be hit. The budget is therefore rounded down to a multiple of a
power of two, the largest not above 1/128 of it (at most 0.8 % less than the exact share;
``vtensor.share_of_peak``): processes whose peaks lie within a few KiB agree unless a multiple
falls between them (for 40 % of a 64.8 MiB peak: 128 KiB steps against KiB of jitter).
"""

from dataclasses import dataclass
from typing import Any

import torch

import vtensor
from edgefl.errors import ConfigError


@dataclass(frozen=True)
class Budget:
    """Exactly one of ``bytes`` (> 0), ``peak_fraction`` (in (0, 1]) or ``auto`` is set.

    ``auto``: what the device can give this process when the budget is resolved
    (``vtensor.device_budget``: the cgroup's limit less its usage, else MemAvailable).
    """

    bytes: int = 0
    peak_fraction: float = 0.0
    auto: bool = False

    def __post_init__(self) -> None:
        forms = (self.bytes > 0) + (self.peak_fraction > 0) + self.auto
        if forms != 1 or self.peak_fraction > 1:
            raise ConfigError(
                f"budget {self!r} must be a byte size, a percentage in (0, 100] or 'auto'"
            )

    def of_peak(self, peak_bytes: int) -> int:
        """The bytes this budget stands for where the unmanaged peak is ``peak_bytes``.

        A share of the peak is rounded down to its quantum (NOTE [budget quantum]).

        Raises:
            ConfigError: ``auto`` where nothing says how much memory the device can give.
        """
        if self.bytes:
            return self.bytes
        if self.auto:
            resolved = vtensor.device_budget(torch.device("cpu"), held_bytes=0)
            if resolved is None:
                raise ConfigError(
                    "budget 'auto': nothing says how much memory this device can give (no cgroup "
                    "limit, no MemAvailable); give the budget in bytes, e.g. '512MiB'"
                )
            return resolved[0]
        return vtensor.share_of_peak(self.peak_fraction, peak_bytes)

    def __str__(self) -> str:
        if self.bytes:
            return vtensor.format_bytes(self.bytes)
        if self.auto:
            return "auto (what the device can give)"
        return f"{100 * self.peak_fraction:g}% of the unmanaged peak"


def parse_budget(value: Any, what: str) -> Budget:
    """``"80%"``: a share of the unmanaged peak; ``"64MiB"``, ``67108864``: bytes; or ``"auto"``."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return Budget(auto=True)
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            percent = float(value.strip()[:-1])
        except ValueError:
            raise ConfigError(
                f"{what}={value!r} is not a percentage such as '80%'; or give bytes or 'auto'"
            ) from None
        if not 0 < percent <= 100:
            raise ConfigError(
                f"{what}={value!r} must be a percentage in (0, 100]; or give bytes or 'auto'"
            )
        return Budget(peak_fraction=percent / 100)
    try:
        return Budget(bytes=vtensor.parse_bytes(value, what=what))
    except vtensor.VTensorError as exc:
        raise ConfigError(
            f"{exc}, or a percentage of the unmanaged peak such as '80%', or 'auto'"
        ) from exc
