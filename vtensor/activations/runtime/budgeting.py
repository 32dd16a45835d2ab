"""A manager's budget: the form it was given in, and the bytes it resolved to."""

from collections.abc import Sequence

import torch

from vtensor.budget import BudgetKind, device_budget, parse_budget, share_of_peak
from vtensor.errors import BudgetFormatError
from vtensor.planner.memory_model import unmanaged_peak
from vtensor.planner.trace import Trace
from vtensor.sizes import format_bytes


class ManagerBudget:
    """The budget of one manager: bytes at once, or resolved at its first steps.

    ``"auto"`` resolves at the first step, from what the device can give; ``"N%"`` runs that
    first (profiled) step under the same, then resolves from its trace's unmanaged peak.
    """

    def __init__(self, budget: int | float | str, *, planned: bool) -> None:
        self.spec = parse_budget(budget)
        if self.spec.kind is BudgetKind.PEAK_SHARE and not planned:
            raise BudgetFormatError(
                f"budget={budget!r} is a share of the unmanaged peak, which the profiled trace "
                "gives: use policy='planned', or a budget in bytes"
            )
        self.nbytes = self.spec.nbytes  # 0 until resolved
        self.source = "given in bytes" if self.nbytes else ""
        self.share_pending = self.spec.kind is BudgetKind.PEAK_SHARE
        self.unmanaged_peak_bytes: int | None = None

    def resolve_device(self, device: torch.device, held_bytes: int) -> None:
        """``"auto"``, or what a share's first step runs under, from what ``device`` can give."""
        resolved = device_budget(device, held_bytes)
        if resolved is None:
            raise BudgetFormatError(
                f"budget={str(self.spec)!r}: nothing says how much memory {device} can give this "
                "process (no cgroup limit, no MemAvailable); give the budget in bytes"
            )
        self.nbytes, self.source = resolved
        if self.share_pending:
            self.source += f"; the profiled iteration, for {self.spec} of its peak"

    def note_profile(
        self, trace: Trace, pending_state_bytes: int, kept: Sequence[tuple[int, int]] = ()
    ) -> bool:
        """A profiled trace (not one that recomputed); whether a share of its peak resolved now.

        ``kept``: as for ``unmanaged_peak``.
        """
        if trace.recomputed:
            return False
        self.unmanaged_peak_bytes = unmanaged_peak(trace, kept) + pending_state_bytes
        if not self.share_pending:
            return False
        self.share_pending = False
        peak = self.unmanaged_peak_bytes
        self.nbytes = share_of_peak(self.spec.peak_fraction, peak)
        self.source = f"{self.spec} of the unmanaged peak, {format_bytes(peak)} (profiled trace)"
        return True
