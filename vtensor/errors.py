"""Error types of the vtensor memory manager: one root, one class per failure a user can act on."""


class VTensorError(Exception):
    """Root of every error raised by vtensor."""


class BudgetFormatError(VTensorError, ValueError):
    """A memory budget could not be parsed or is not positive."""


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
