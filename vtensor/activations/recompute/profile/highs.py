"""How far each unit's forward took the bytes it made: its working set, rerun."""

from dataclasses import dataclass, field


@dataclass
class UnitHighs:
    """How far each unit's forward took the bytes (NOTE [recomputation's working set]).

    NOTE [recomputation's working set]
    A recomputed forward holds more than the saved tensors it brings back: outputs no op saves,
    its own output, tensors too small to manage. So the profile notes per unit how far its
    forward raised the readings outside vTensors plus every byte saved so far
    (``TraceUnit.working_bytes``).
    """

    now: int = 0  # the last reading outside vTensors plus the bytes saved into them so far
    saved: int = 0
    open: list[list[int]] = field(default_factory=list)  # [at its start, highest] per unit

    def note(self, unmanaged: int) -> None:
        """A reading of ``unmanaged`` bytes outside vTensors."""
        self.now = unmanaged + self.saved
        for watch in self.open:
            watch[1] = max(watch[1], self.now)

    def begin(self) -> list[int]:
        """A unit's forward begins: its watch, for :meth:`end`."""
        watch = [self.now, self.now]
        self.open.append(watch)
        return watch

    def end(self, watch: list[int]) -> int:
        """The unit of ``watch`` returned: how far the bytes rose inside it."""
        # By identity: two nested units that began at the same reading hold equal lists.
        self.open = [w for w in self.open if w is not watch]
        return max(0, watch[1] - watch[0])
