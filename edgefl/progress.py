"""Clients finished out of those sent, while a round's train phase runs.

In a terminal a bar on one line, redrawn as replies come; otherwise (a log file, a pipe) one
log line per client that replied.
"""

import logging
import sys
from typing import TextIO

logger = logging.getLogger(__name__)
_BAR_WIDTH = 24


class TrainProgress:
    """``update(server_round, done, total)`` after every reply of a train phase."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()

    def update(self, server_round: int, done: int, total: int) -> None:
        """Show that ``done`` of the ``total`` clients of round ``server_round`` replied."""
        if not self._tty:
            logger.info("round %d: %d/%d clients finished training", server_round, done, total)
            return
        filled = _BAR_WIDTH * done // max(1, total)
        bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
        end = "\n" if done >= total else ""
        self._stream.write(f"\rround {server_round} training [{bar}] {done}/{total} clients{end}")
        self._stream.flush()
