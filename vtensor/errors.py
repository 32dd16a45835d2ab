"""Error types of the vtensor memory manager: one root, one class per failure a user can act on."""

import os
from dataclasses import dataclass
from pathlib import Path


class VTensorError(Exception):
    """Root of every error raised by vtensor."""


class BudgetFormatError(VTensorError, ValueError):
    """A memory budget could not be parsed or is not positive."""


class UnmeasurableMemoryError(VTensorError):
    """This process's CPU memory cannot be measured honestly, so no budget could be enforced."""


@dataclass(frozen=True)
class FloorBreakdown:
    """What holds an iteration's smallest budget, in bytes.

    Attributes:
        parameters: parameters and buffers in memory.
        gradients: gradients of the trainable parameters.
        optimizer_state: the optimizer's state, with what its first step creates.
        inputs: the batch given as ``inputs``.
        working_set: what the step that holds the floor allocates beyond the saved tensors
            (its outputs, gradients in flight, temporaries).
        kept_activations: saved tensors that cannot leave memory at that step (in use, or
            too small to move).
        offloaded_floor_bytes: about the floor with the parameters, gradients and optimizer
            state offloaded (0: not estimated).
        offload_needed: the minimum is the one with the parameter side offloaded.
        offloaded_held: with the parameter side offloaded, its bytes in memory at that step
            (the layers in use, their gradients and optimizer state).
    """

    parameters: int
    gradients: int
    optimizer_state: int
    inputs: int
    working_set: int
    kept_activations: int
    offloaded_floor_bytes: int = 0
    offload_needed: bool = False
    offloaded_held: int = 0

    @property
    def state(self) -> int:
        """Parameters, gradients and optimizer state."""
        return self.parameters + self.gradients + self.optimizer_state

    def describe(self) -> str:
        """One line of the parts, largest first."""
        parts = {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer state": self.optimizer_state,
            "inputs": self.inputs,
            "the step's working set": self.working_set,
            "activations that cannot leave": self.kept_activations,
            "offloaded parameters, gradients and optimizer state in use": self.offloaded_held,
        }
        ranked = sorted(parts.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{name} {_mib(n)}" for name, n in ranked if n)

    def advice(self, min_budget_bytes: int) -> str:
        """What lowers the floor: offloading where the state holds it, else a smaller batch."""
        raise_to = (
            f"Raise the budget to at least {min_budget_bytes} bytes ({_mib(min_budget_bytes)})"
        )
        if self.offloaded_held > self.working_set + self.kept_activations:
            return (
                f"{raise_to}: the layers in use hold the floor with their gradients and "
                "optimizer state, even offloaded."
            )
        if self.offload_needed:
            return (
                f"{raise_to}, with the parameters, gradients and optimizer state offloaded "
                "(offload_params='auto' or True)."
            )
        held = self.state > self.working_set + self.kept_activations
        if held and 0 < self.offloaded_floor_bytes < min_budget_bytes:
            return (
                f"{raise_to}, or offload the parameters (MemoryManager(offload_params=True)): "
                f"parameters, gradients and optimizer state hold the floor, which then falls "
                f"to about {_mib(self.offloaded_floor_bytes)}."
            )
        if held:
            return f"{raise_to}: parameters, gradients and optimizer state hold the floor."
        return f"{raise_to}, or lower the batch size: the activations hold the floor."


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


class InfeasibleBudgetError(VTensorError):
    """The budget is below what one iteration needs even with every evictable byte swapped out.

    Attributes:
        budget_bytes: the budget that was asked for.
        min_budget_bytes: the smallest budget that would have worked for the whole iteration.
        step: name of the step that dominates the minimum.
        breakdown: what holds that minimum (None where not measured).
    """

    def __init__(
        self,
        budget_bytes: int,
        min_budget_bytes: int,
        step: str,
        detail: str = "",
        breakdown: FloorBreakdown | None = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes
        self.step = step
        self.breakdown = breakdown
        msg = (
            f"memory budget of {budget_bytes} bytes ({_mib(budget_bytes)}) cannot be met: "
            f"the iteration needs at least {min_budget_bytes} bytes ({_mib(min_budget_bytes)}) "
            f"at step {step!r} with everything evictable swapped out"
        )
        if breakdown is not None:
            msg += f" ({breakdown.describe()}). {breakdown.advice(min_budget_bytes)}"
        else:
            msg += f". Raise the budget to at least {min_budget_bytes} bytes."
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class IllegalMoveError(VTensorError):
    """A chunk was asked to move between residency states that have no legal transition."""


class InPlaceModificationError(VTensorError, RuntimeError):
    """A tensor saved for backward was modified in place before backward used it."""


class StorageTierError(VTensorError, OSError):
    """The storage tier could not write or read a chunk (disk full, unreadable directory, ...)."""


class SwapAuthenticationError(VTensorError):
    """A sealed swap-file extent failed authentication: modified, stale, swapped or corrupted.

    The chunk's bytes are never returned: they were replaced on storage after vtensor wrote
    them, so the step cannot continue from them.
    """


class ParamOffloadError(VTensorError):
    """The model or optimizer cannot be trained with parameter offloading as configured."""


class LayeringError(VTensorError):
    """The model cannot be run with demand layering as called; the message says what to change."""


class WeightFileError(VTensorError):
    """A weight file cannot be used; ``path`` names it."""

    def __init__(self, path: str | os.PathLike[str], message: str) -> None:
        self.path = Path(path)
        super().__init__(f"weight file {str(self.path)!r}: {message}")


class WeightFileFormatError(WeightFileError):
    """Not a weight file this project reads (wrong magic), or its header is malformed."""


class WeightFileVersionError(WeightFileError):
    """The file was written in a newer format version than this vtensor reads."""


class WeightFileTruncatedError(WeightFileError):
    """The file is shorter than its header says: an interrupted copy or write."""


class WeightFileChecksumError(WeightFileError):
    """A tensor's bytes (or the header) do not match the CRC-32 written with them."""


class WeightFileMismatchError(WeightFileError):
    """The file does not match the model: missing or extra names, other shapes or dtypes."""
