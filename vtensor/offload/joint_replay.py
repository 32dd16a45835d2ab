"""The parameter side of a replayed joint plan (NOTE [one plan] in ``offload/joint.py``)."""

from collections.abc import Callable

from vtensor.offload.offloaded import OffloadedTensor
from vtensor.offload.pool import OffloadPool
from vtensor.planner.plan import Plan
from vtensor.planner.trace import TraceTensor


class ParamPlanExecutor:
    """Replays the parameter side of a joint plan through an ``OffloadPool`` (NOTE [one plan]).

    Once ``active()`` (the activation replay) is False, the pool's own policy takes over.
    """

    def __init__(self, plan: Plan, pool: OffloadPool, active: Callable[[], bool]) -> None:
        self.plan = plan
        self.pool = pool
        self._active = active
        self.step = -1
        self.missed = 0
        n = len(plan.step_names)
        self._vids = {name: vid for vid, name in enumerate(plan.tensor_names) if name}
        self._shed: set[str] = set()  # let go where the budget needed them gone
        self._windows: dict[str, list[tuple[int, int]]] = {}
        self._evict: dict[int, list[str]] = {}
        self._fetch: dict[int, list[str]] = {}
        names = plan.tensor_names
        for move in plan.moves:
            if move.vid < len(names) and names[move.vid]:
                name = names[move.vid]
                self._windows.setdefault(name, []).append((move.evict_step, move.prefetch_step))
                self._evict.setdefault(move.evict_step, []).append(name)
                if move.prefetch_step < n:
                    self._fetch.setdefault(move.prefetch_step, []).append(name)

    def _away(self, name: str, step: int) -> bool:
        return any(first <= step < stop for first, stop in self._windows.get(name, ()))

    def _entries(self) -> dict[str, OffloadedTensor]:
        return {e.name: e for e in self.pool.tensors if not self.pool.is_fixed(e)}

    # -- pool listener --------------------------------------------------------------------
    def adopted(self, entry: OffloadedTensor) -> None:  # noqa: D102
        pass

    def used(self, entry: OffloadedTensor) -> None:  # noqa: D102
        pass

    def released(self, entry: OffloadedTensor) -> None:  # noqa: D102
        pass

    def forgotten(self, entry: OffloadedTensor) -> None:  # noqa: D102
        pass

    def holds(self, entry: OffloadedTensor) -> bool:
        """Keep ``entry`` in memory while the plan has it resident."""
        if not self._active() or entry.name not in self._vids or entry.name in self._shed:
            return False
        return not self._away(entry.name, self.step)

    # -- the iteration ----------------------------------------------------------------------
    def on_step(self, index: int) -> list[OffloadedTensor]:
        """Step ``index`` begins: let go of what the plan evicts; returns what to :meth:`read`.

        The iteration makes room for each read under the shared budget before starting it.
        """
        self.step = index
        if not self._active():
            return []
        evict, fetch = self._evict.get(index, []), self._fetch.get(index, [])
        if not evict and not fetch and index != 0:
            return []
        entries = self._entries()
        for name in evict:
            entry = entries.get(name)
            if entry is None or not entry.in_memory:
                continue
            if entry.pins or entry.wanted:
                self.missed += 1
            self.pool.let_go(entry)
        if index == 0:
            # The pool's own policy may have let go of what the plan has resident at the start.
            fetch = [n for n in self._vids if n in entries and not self._away(n, 0)]
        reads = [entries[name] for name in fetch if name in entries]
        return [entry for entry in reads if self.pool.must_read(entry)]

    def read(self, entry: OffloadedTensor) -> None:
        """Start reading ``entry``, which the plan has resident from now on."""
        self.pool.read_held(entry)

    def resident_bytes(self) -> int:
        """Bytes of movable parameter-side tensors in memory."""
        return self.pool.meter.resident_bytes - self.pool.fixed_bytes

    def shed(self, nbytes: int) -> None:
        """Let go of held, unused tensors until ``nbytes`` left: the plan kept too much."""
        freed = 0
        for entry in self.pool.tensors:
            if freed >= nbytes:
                break
            if entry.in_memory and not entry.pins and self.holds(entry):
                self._shed.add(entry.name)
                self.pool.let_go(entry)
                freed += entry.nbytes
        self.pool.reap(block=True)

    def settle(self) -> None:
        """Wait for the pool's writes in flight, which hold their bytes until done."""
        self.pool.reap(block=True)

    def unoffloaded_bytes(self) -> int:
        """What its tensors would hold in memory now, were they never offloaded."""
        return self.pool.unoffloaded_bytes()

    def largest_bytes(self) -> int:
        """Bytes of its largest movable tensor, which moves whole."""
        return self.pool.largest_bytes()

    def pinned_bytes(self) -> int:
        """Bytes of movable parameter-side tensors that a use holds in memory now."""
        return self.pool.pinned_bytes()

    def trace_tensors(self, first_vid: int, n_steps: int) -> list[TraceTensor]:
        """Nothing: a replayed iteration is not traced."""
        return []
