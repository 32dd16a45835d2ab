"""Logging for entry points: edgefl's INFO lines on stderr, Flower's at a chosen level."""

import logging
import sys

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(flower_level: str = "WARNING") -> None:
    """Give the ``edgefl`` logger a stderr handler (once) and set Flower's logger level."""
    edgefl_logger = logging.getLogger("edgefl")
    if not any(getattr(h, "_edgefl", False) for h in edgefl_logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        handler._edgefl = True  # type: ignore[attr-defined]
        edgefl_logger.addHandler(handler)
        edgefl_logger.propagate = False
    edgefl_logger.setLevel(logging.INFO)
    logging.getLogger("flwr").setLevel(flower_level.upper())
