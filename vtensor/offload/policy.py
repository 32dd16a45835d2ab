"""Which layers' tensors to read ahead: the order of uses seen in the first step, ``k`` ahead.

Policy only: it returns uses; the pool decides whether their tensors fit. A wrong guess costs a
read and memory, never correctness: every use waits on its own tensors. The forward and backward
passes read ahead; the clip-and-update pass of ``step()`` reads each unit's tensors on demand.
"""

from dataclasses import dataclass
from enum import StrEnum


class Phase(StrEnum):
    """When a unit uses its tensors."""

    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class Event:
    """One use of a unit's tensors."""

    phase: Phase
    unit: int


_ORDER = (Phase.FORWARD, Phase.BACKWARD)


class Lookahead:
    """Prefetch the tensors of the next ``depth`` uses, in the order the first step made them."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.schedule: list[Event] = []

    def record(self, event: Event, position: int) -> None:
        """Append ``event``, the ``position``-th use of its phase, unless already recorded."""
        if sum(e.phase is event.phase for e in self.schedule) == position:
            self.schedule.append(event)

    def upcoming(self, phase: Phase, position: int) -> list[Event]:
        """The uses after the ``position``-th of ``phase``, wrapping to the next step."""
        ordered = sorted(self.schedule, key=lambda e: _ORDER.index(e.phase))
        start = sum(_ORDER.index(e.phase) < _ORDER.index(phase) for e in ordered) + position
        if not ordered or start >= len(ordered) or ordered[start].phase is not phase:
            return []
        count = min(self.depth, len(ordered) - 1)
        return [ordered[(start + i) % len(ordered)] for i in range(1, count + 1)]

    def update_order(self, units: int) -> list[int]:
        """Units in the order the update pass visits them: backward's order, then the rest."""
        backward = [e.unit for e in self.schedule if e.phase is Phase.BACKWARD]
        return list(dict.fromkeys([*backward, *range(units)]))
