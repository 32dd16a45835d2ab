"""Plain-data report of parameter offloading: bytes held (exact), moved and waited for."""

from dataclasses import dataclass

from vtensor.sizes import format_bytes


@dataclass(frozen=True)
class ParamOffloadReport:
    """What parameter offloading held and moved since it started.

    Attributes:
        budget_bytes: the budget for parameters, gradients and optimizer state in memory.
        min_budget_bytes: the smallest budget this model, optimizer and configuration allow.
        param_bytes, grad_bytes, state_bytes: what unmanaged training holds (its footprint).
        resident_bytes: parameter, gradient and state bytes in memory now.
        peak_resident_bytes: the most at any moment, counted at every allocation and release
            the offloader makes or sees.
        step_peak_bytes: the peak of each ``step()``.
        bytes_out, bytes_in: bytes written to and read from the storage tier.
        stall_s: seconds training waited on transfers still in flight.
        steps: completed ``step()`` calls.
    """

    budget_bytes: int
    min_budget_bytes: int
    param_bytes: int
    grad_bytes: int
    state_bytes: int
    resident_bytes: int
    peak_resident_bytes: int
    step_peak_bytes: tuple[int, ...]
    bytes_out: int
    bytes_in: int
    stall_s: float
    steps: int

    @property
    def footprint_bytes(self) -> int:
        """Parameters + gradients + optimizer state, as unmanaged training holds them."""
        return self.param_bytes + self.grad_bytes + self.state_bytes

    def __str__(self) -> str:
        """One line a person reads; the fields hold the rest."""
        footprint, peak = format_bytes(self.footprint_bytes), format_bytes(self.peak_resident_bytes)
        return (
            f"{self.steps} steps: parameters, gradients and optimizer state {footprint}, at most "
            f"{peak} in memory under a {format_bytes(self.budget_bytes)} budget; moved "
            f"{format_bytes(self.bytes_out)} out, {format_bytes(self.bytes_in)} in, stall "
            f"{self.stall_s:.3f} s"
        )
