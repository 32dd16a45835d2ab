"""Error types of edgefl: one root, one class per failure a user can act on."""


class EdgeFLError(Exception):
    """Root of every error raised by edgefl."""


class ConfigError(EdgeFLError, ValueError):
    """A configuration value is missing, malformed or inconsistent with another one."""


class DatasetMissingError(EdgeFLError, FileNotFoundError):
    """A dataset's files are not installed; the message says how to install them."""


class DatasetCorruptError(EdgeFLError, ValueError):
    """A dataset's files were found but hold something other than what the loader expects."""


class PartitionError(EdgeFLError, ValueError):
    """Data cannot be split into the requested partitions."""


class ModelDataMismatchError(EdgeFLError, ValueError):
    """A model was asked to run on data of a shape or kind it does not accept."""


class ClientBudgetError(EdgeFLError):
    """A client cannot train within its memory budget (carries vtensor's minimum)."""

    def __init__(self, message: str, budget_bytes: int, min_budget_bytes: int) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes
