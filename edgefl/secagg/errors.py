"""Errors of secure aggregation: a round that cannot complete, a message against the protocol."""

from edgefl.errors import EdgeFLError
from edgefl.rounds import RoundAborted


class SecAggError(EdgeFLError):
    """Root of every secure-aggregation error."""


class SecAggAbortedError(SecAggError, RoundAborted):
    """A round stopped before unmasking: too few clients left to reconstruct the secrets.

    Raised before any aggregate exists, so the global model and the inner strategy's state are
    unchanged.
    """

    def __init__(self, message: str, server_round: int, stage: str) -> None:
        super().__init__(message)
        self.server_round = server_round
        self.stage = stage


class SecAggProtocolError(SecAggError):
    """A client received a message that the protocol does not allow at this point."""
