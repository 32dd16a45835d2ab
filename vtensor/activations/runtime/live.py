"""An iteration's tracked device bytes: the reading, and the growth the guard keeps as headroom."""

import torch

from vtensor.activations.runtime.param_side import ResidentParams
from vtensor.activations.store.chunk_store import ChunkStore
from vtensor.measure.trackers import DeviceTracker


class LiveBytes:
    """Reads the tracked bytes of one iteration and the growth between two readings.

    The counters are process-wide (the heap counter on CPU; on CUDA the allocator's count of
    every tensor on the device: other models, other managers' steps, cuBLAS's workspaces), so
    the growth since entry is counted on top of ``baseline_bytes``, the tensors known to exist
    at entry: the budget means the same on both devices.
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
        # Where the guard last acted (NOTE [step reserve]): the reading, parameters, restores
        # started, recomputed bytes announced since, evictions completed.
        self._mark = (0, 0, 0, 0, 0)
        self.recomputed_bytes = 0  # growth of the recomputations since the last noted reading

    def read(self) -> int:
        """Tracked device bytes now."""
        now = self.tracker.current_bytes()
        # Pages released in place are still allocated for the heap counter: subtracted. The
        # resident pages see them leave by themselves (NOTE [release in place] in io/pages.py).
        # Frees of memory allocated before the step (a previous loss, say) lower the counter
        # below its entry value; never report less than nothing.
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

        Parameters read, restores started and recomputations are the manager's own; a replayed
        plan places them, so they are left out. Evictions completed since are added back: when
        they complete depends on the disk and the load, and a replay whose writes were still in
        flight rises by all that was allocated (NOTE [gross rise] in ``planner/reserves.py``).
        """
        level, params, restored, recomputed, evicted = self._mark
        announced = max(0, self._param_bytes() - params) + recomputed
        freed = self.store.stats.bytes_out - evicted
        return live - level - announced - (self.store.restored_bytes - restored) + freed

    def growth(self, live: int) -> int:
        """Growth since the last noted reading that nobody announced: the guard's headroom.

        Reads of the parameter offloading sharing the budget are announced (``make_room``) and,
        under a joint plan, planned; they are not headroom the guard must keep. The growth of
        recomputations is in it, and apart in ``recomputed_bytes`` (NOTE [recomputed growth]).
        """
        return live - self._last_live - max(0, self._param_bytes() - self._last_param)

    def _param_bytes(self) -> int:
        return self.params.resident_bytes() if self.params is not None else 0
