"""Error types of the vtensor memory manager: one root, one class per failure a user can act on."""

import os
from pathlib import Path


class VTensorError(Exception):
    """Root of every error raised by vtensor."""


class BudgetFormatError(VTensorError, ValueError):
    """A memory budget could not be parsed or is not positive."""


class UnmeasurableMemoryError(VTensorError):
    """This process's CPU memory cannot be measured honestly, so no budget could be enforced."""


class InfeasibleBudgetError(VTensorError):
    """The budget is below what one step needs even with every evictable byte swapped out.

    Attributes:
        budget_bytes: the budget that was asked for.
        min_budget_bytes: the smallest budget that would have worked for the observed iteration.
        step: name of the step that dominates the minimum.
    """

    def __init__(
        self, budget_bytes: int, min_budget_bytes: int, step: str, detail: str = ""
    ) -> None:
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes
        self.step = step
        msg = (
            f"memory budget of {budget_bytes} bytes ({budget_bytes / 2**20:.1f} MiB) "
            "cannot be met: "
            f"step {step!r} needs at least {min_budget_bytes} bytes "
            f"({min_budget_bytes / 2**20:.1f} MiB) with everything evictable swapped out. "
            f"Raise the budget to at least {min_budget_bytes} bytes, or lower the batch size."
        )
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
