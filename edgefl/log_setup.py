"""Logging for entry points: the project's INFO lines on stderr, Flower's at a chosen level.

NOTE [Flower noise]: the main job runs on ``flwr.simulation.run_simulation`` (NOTE [simulation
path] in edgefl.sim), which Flower 1.42 flags as deprecated on every call, and each Ray actor
says "Manually terminating ClientAppActor" when the run ends normally. Neither says anything
about the run, so exactly those two records are dropped (``FlowerNoise``); every other Flower
record at or above the chosen level is kept.
"""

import logging
import sys

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_OWN_LOGGERS = ("edgefl", "strategies")  # the project's packages: their INFO lines are shown
_NOISE = (
    "The `run_simulation` function is deprecated",
    "Manually terminating ClientAppActor",
)


class FlowerNoise(logging.Filter):
    """Drops the Flower records of NOTE [Flower noise], keeps every other."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False for a record of NOTE [Flower noise]."""
        text = record.getMessage()
        return not any(noise in text for noise in _NOISE)


def configure_logging(flower_level: str = "WARNING") -> None:
    """Give the project's loggers a stderr handler (once); set Flower's level and filter."""
    for name in _OWN_LOGGERS:
        own = logging.getLogger(name)
        if not any(getattr(h, "_edgefl", False) for h in own.handlers):
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
            handler._edgefl = True  # type: ignore[attr-defined]
            own.addHandler(handler)
            own.propagate = False
        own.setLevel(logging.INFO)
    flower = logging.getLogger("flwr")
    flower.setLevel(flower_level.upper())
    # Flower's console handler takes its level from FLWR_LOG_LEVEL, which edgefl's deploy
    # commands set for the processes they start: in those, this run's setting decides.
    shared = logging.getLogger().handlers  # a job's log file, lent to Flower: not its to set
    for flower_handler in flower.handlers:
        if flower_handler not in shared:
            flower_handler.setLevel(flower_level.upper())
    if not any(isinstance(f, FlowerNoise) for f in flower.filters):
        flower.addFilter(FlowerNoise())
