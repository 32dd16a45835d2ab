"""What the activation side knows of the parameter offloading that shares its budget."""

from collections.abc import Sequence
from typing import Any, Protocol

from vtensor.planner.trace import TraceTensor


class ResidentParams(Protocol):
    """Parameter offloading that shares the budget: the bytes of it now resident."""

    def resident_bytes(self) -> int:
        """Bytes of its parameters, gradients and state on the device now."""
        ...

    def largest_bytes(self) -> int:
        """Bytes of its largest tensor, which moves whole."""
        ...

    def pinned_bytes(self) -> int:
        """Of those, the bytes a use holds (the rest were read ahead, and may leave)."""
        ...

    def unoffloaded_bytes(self) -> int:
        """What it would hold on the device now were it never offloaded (an offload probe)."""
        ...


class PlannedRead(Protocol):
    """A tensor of the parameter side that a joint plan reads at a step."""

    nbytes: int


class ParamSide(ResidentParams, Protocol):
    """The parameter offloading that shares the iteration's budget (``offload/joint.py``)."""

    def traced_bytes(self) -> int:
        """Of the resident bytes, those its trace tensors place (the rest count unmanaged)."""
        ...

    def on_step(self, index: int) -> Sequence[PlannedRead]:
        """Step ``index`` begins; returns the reads the plan starts now, in order."""
        ...

    def shed(self, nbytes: int) -> None:
        """Let go of up to ``nbytes`` it holds but does not use now (the budget needs them)."""
        ...

    def writing_bytes(self) -> int:
        """Bytes of its writes in flight, which hold their memory until done."""
        ...

    def settle(self) -> None:
        """Wait for its writes in flight: the bytes they hold leave memory."""
        ...

    def read(self, entry: Any) -> None:
        """Start one read that :meth:`on_step` returned (room was made for it)."""
        ...

    def trace_tensors(self, first_vid: int, n_steps: int) -> list[TraceTensor]:
        """Its tensors as trace tensors (profiling), numbered from ``first_vid``."""
        ...
