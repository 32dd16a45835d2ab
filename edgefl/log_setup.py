"""Logging for entry points: edgefl's INFO lines on stderr, Flower's at a chosen level."""

import logging
import sys

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


_OWN_LOGGERS = ("edgefl", "strategies")  # the project's packages: their INFO lines are shown


def configure_logging(flower_level: str = "WARNING") -> None:
    """Give the project's loggers a stderr handler (once) and set Flower's logger level."""
    for name in _OWN_LOGGERS:
        own = logging.getLogger(name)
        if not any(getattr(h, "_edgefl", False) for h in own.handlers):
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
            handler._edgefl = True  # type: ignore[attr-defined]
            own.addHandler(handler)
            own.propagate = False
        own.setLevel(logging.INFO)
    logging.getLogger("flwr").setLevel(flower_level.upper())
