"""An iteration's tracked device bytes: the reading, and the growth the guard keeps as headroom."""

import torch

from vtensor.activations.runtime.param_side import ResidentParams
from vtensor.activations.store.chunk_store import ChunkStore
from vtensor.measure.trackers import DeviceTracker


class LiveBytes:
    """Reads the tracked bytes of one iteration and the growth between two readings.

    The counters are process-wide, so the growth since entry counts on top of ``baseline_bytes``.
    """

    def __init__(
        self,
        tracker: DeviceTracker,
        store: ChunkStore,
        device: torch.device,
        baseline_bytes: int,
        params: ResidentParams | None = None,
    ) -> None:
        self.tracker = tracker
        self.store = store
        self.baseline_bytes = baseline_bytes
        self.params = params
        tracker.settle()  # the allocator's kept pages out of the entry reading
        self._entry_counter = tracker.current_bytes()
        self._entry_released = store.released_bytes
        self._last_live = 0
        self._last_param = 0
        # Where the guard last acted (NOTE [step reserve]): reading, parameters, restores,
        # recomputed bytes, evictions completed.
        self._mark = (0, 0, 0, 0, 0)
        self.recomputed_bytes = 0  # growth of the recomputations since the last noted reading

    def read(self) -> int:
        """Tracked device bytes now."""
        now = self.tracker.current_bytes()
        # The heap counter still counts pages released in place (NOTE [release in place] in
        # io/pages.py). Frees of older memory can take the reading below zero: clamp.
        released = 0
        if not self.tracker.counts_released_pages:
            released = self.store.released_bytes - self._entry_released
        return max(0, self.baseline_bytes + now - self._entry_counter - released)

    def note(self, live: int) -> None:
        """``live`` is the reading the next growth is measured from."""
        self._last_live = live
        self._last_param = self._param_bytes()
        self.recomputed_bytes = 0

    def announce_recomputed(self, nbytes: int) -> None:
        """A recomputation grew the tracked bytes by ``nbytes`` (NOTE [recomputed growth])."""
        self.recomputed_bytes += max(0, nbytes)
        level, params, restored, recomputed, evicted = self._mark
        self._mark = (level, params, restored, recomputed + max(0, nbytes), evicted)

    def mark(self, live: int) -> None:
        """The guard acted at the reading ``live``: :meth:`rise` is measured from it."""
        stats = self.store.stats
        self._mark = (live, self._param_bytes(), self.store.restored_bytes, 0, stats.bytes_out)

    def rise(self, live: int) -> int:
        """How far the model's allocations took ``live`` above the guard's last reading.

        The plan's own reads, restores and recomputations are left out; completed evictions are
        added back (NOTE [gross rise]).
        """
        level, params, restored, recomputed, evicted = self._mark
        announced = max(0, self._param_bytes() - params) + recomputed
        freed = self.store.stats.bytes_out - evicted
        return live - level - announced - (self.store.restored_bytes - restored) + freed

    def growth(self, live: int) -> int:
        """Unannounced growth since the last noted reading (NOTE [recomputed growth])."""
        return live - self._last_live - max(0, self._param_bytes() - self._last_param)

    def _param_bytes(self) -> int:
        return self.params.resident_bytes() if self.params is not None else 0
