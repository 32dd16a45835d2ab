"""The parameter side of a joint iteration: recorded while profiled, replayed from its plan.

NOTE [fresh in their step]
A tensor a step creates and adopts (a gradient) was counted among the step's unmanaged bytes
until adopted; a trace tensor from that step as well would count it twice at the step's peak.
So while profiled, a tensor counts as unmanaged through the step that created it, and one that
step also lets go of (a gradient its update consumed) is no trace tensor at all: the step's
unmanaged peak holds it where it was. One that outlives the step is both in that step
(conservative) and a trace tensor from there on. A plain loop keeps each gradient to the
iteration's end: its unmanaged peak adds the consumed ones back from their step on
(``consumed``, ``planner/memory_model.py``'s ``unmanaged_peak``).
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from vtensor.offload.offloaded import OffloadedTensor, Residency
from vtensor.offload.pool import OffloadPool
from vtensor.planner.plan import Plan
from vtensor.planner.trace import TensorKind, TraceTensor


@dataclass
class _Life:
    """What a profiled iteration learns about one parameter-side tensor."""

    nbytes: int
    dtype: str
    kind: TensorKind
    start: int
    existed: bool
    uses: set[int] = field(default_factory=set)
    pinned_at: int = -1
    end: int | None = None  # step at which it was forgotten
    dirty_step: int = -1

    @staticmethod
    def of(entry: OffloadedTensor, start: int, existed: bool) -> "_Life":
        dtype = str(entry.tensor.dtype).replace("torch.", "")
        return _Life(entry.nbytes, dtype, entry.kind, start, existed)

    def unpin(self, now: int) -> None:
        """Held from its pin to ``now``: each of those steps is a use."""
        if self.pinned_at >= 0:
            self.uses.update(range(self.pinned_at, now + 1))
            self.pinned_at = -1


class JointSide:
    """The pool's listener in a joint iteration, and what the iteration asks of the pool.

    Without a ``plan`` it records the iteration (NOTE [one plan] in ``offload/joint.py``); with
    one it replays it until ``active()`` (the activation replay) is False, when the pool's own
    policy takes over.
    """

    def __init__(self, pool: OffloadPool, plan: Plan | None, active: Callable[[], bool]) -> None:
        self.pool, self.plan, self._active = pool, plan, active
        # -1: before its first step a replay holds everything the plan has resident.
        self.step = 0 if plan is None else -1
        self.created_state = False
        self._lives: dict[str, _Life] = {}
        self._fresh_now: list[OffloadedTensor] = []  # adopted in the running step (recording)
        self._planned: dict[str, None] = {}  # names the plan places, in its order
        self._shed: set[str] = set()  # let go where the budget needed them gone
        self._windows: dict[str, list[tuple[int, int]]] = {}
        self._evict: dict[int, list[str]] = {}
        self._fetch: dict[int, list[str]] = {}
        if plan is None:
            for entry in pool.tensors:
                if not pool.is_fixed(entry):
                    self._lives[entry.name] = _Life.of(entry, start=0, existed=True)
            return
        names, n = plan.tensor_names, len(plan.step_names)
        self._planned = dict.fromkeys(name for name in names if name)
        for move in plan.moves:
            if move.vid < len(names) and names[move.vid]:
                name = names[move.vid]
                self._windows.setdefault(name, []).append((move.evict_step, move.prefetch_step))
                self._evict.setdefault(move.evict_step, []).append(name)
                if move.prefetch_step < n:
                    self._fetch.setdefault(move.prefetch_step, []).append(name)

    def _replaying(self) -> bool:
        return self.plan is not None and self._active()

    def _away(self, name: str, step: int) -> bool:
        return any(first <= step < stop for first, stop in self._windows.get(name, ()))

    # -- pool listener: recording -------------------------------------------------------------
    def adopted(self, entry: OffloadedTensor) -> None:
        """``entry`` is managed from now on."""
        if self.plan is not None or self.pool.is_fixed(entry):
            return
        if entry.kind is TensorKind.STATE:
            self.created_state = True  # a first update: later iterations will differ
        self._lives[entry.name] = _Life.of(entry, start=max(self.step, 0), existed=False)
        self._fresh_now.append(entry)

    def used(self, entry: OffloadedTensor) -> None:
        """A use pinned ``entry``."""
        life = self._lives.get(entry.name)
        if life is not None:
            if entry.pins == 0:
                life.pinned_at = self.step
            life.uses.add(self.step)

    def released(self, entry: OffloadedTensor) -> None:
        """A use of ``entry`` ended."""
        life = self._lives.get(entry.name)
        if life is None:
            return
        if entry.pins == 0:
            life.unpin(self.step)
        if not entry.clean:
            life.dirty_step = self.step

    def forgotten(self, entry: OffloadedTensor) -> None:
        """``entry`` is no longer managed."""
        life = self._lives.get(entry.name)
        if life is not None:
            life.unpin(self.step)
            life.uses.add(self.step)
            life.end = self.step

    # -- pool listener: replaying -------------------------------------------------------------
    def holds(self, entry: OffloadedTensor) -> bool:
        """True to keep the unpinned ``entry`` in memory: the plan has it resident now."""
        if not self._replaying() or entry.name not in self._planned or entry.name in self._shed:
            return False
        return not self._away(entry.name, self.step)

    # -- the iteration ------------------------------------------------------------------------
    def on_step(self, index: int) -> list[OffloadedTensor]:
        """Step ``index`` begins: let go of what the plan evicts; returns what to :meth:`read`.

        The iteration makes room for each read under the shared budget before starting it.
        """
        self.step = index
        self._fresh_now.clear()
        if not self._replaying():
            return []
        evict, fetch = self._evict.get(index, []), self._fetch.get(index, [])
        if not evict and not fetch and index != 0:
            return []
        entries = {e.name: e for e in self.pool.tensors if not self.pool.is_fixed(e)}
        for name in evict:
            entry = entries.get(name)
            if entry is not None and entry.in_memory:
                self.pool.let_go(entry)
        if index == 0:
            # The pool's own policy may have let go of what the plan has resident at the start.
            fetch = [n for n in self._planned if n in entries and not self._away(n, 0)]
        reads = [entries[name] for name in fetch if name in entries]
        return [entry for entry in reads if self.pool.must_read(entry)]

    def read(self, entry: OffloadedTensor) -> None:
        """Start reading ``entry``, which the plan has resident from now on."""
        if self.pool.must_read(entry):
            entry.fetch()

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

    def writing_bytes(self) -> int:
        """Bytes of the pool's writes in flight: counted gone by the plan, still in memory."""
        return sum(e.nbytes for e in self.pool.tensors if e.state is Residency.WRITING)

    def resident_bytes(self) -> int:
        """Bytes of movable parameter-side tensors in memory."""
        return self.pool.meter.resident_bytes - self.pool.fixed_bytes

    def traced_bytes(self) -> int:
        """Of ``resident_bytes``, those the trace places (NOTE [fresh in their step])."""
        return self.resident_bytes() - sum(e.nbytes for e in self._fresh_now if e.in_memory)

    def unoffloaded_bytes(self) -> int:
        """What its tensors would hold in memory now, were they never offloaded."""
        return self.pool.unoffloaded_bytes()

    def largest_bytes(self) -> int:
        """Bytes of its largest movable tensor, which moves whole."""
        return self.pool.largest_bytes()

    def pinned_bytes(self) -> int:
        """Bytes of movable parameter-side tensors that a use holds in memory now."""
        pool = self.pool
        return sum(
            e.nbytes for e in pool.tensors if e.in_memory and e.pins and not pool.is_fixed(e)
        )

    def consumed(self) -> list[tuple[int, int]]:
        """``(step, bytes)`` of each tensor a step made and let go (NOTE [fresh in their step])."""
        lives = self._lives.values()
        return [(life.start, life.nbytes) for life in lives if self._consumed(life)]

    @staticmethod
    def _consumed(life: _Life) -> bool:
        return not life.existed and life.start == life.end

    def trace_tensors(self, first_vid: int, n_steps: int) -> list[TraceTensor]:
        """The recorded tensors as trace tensors, by name, numbered from ``first_vid``."""
        tensors: list[TraceTensor] = []
        for name in sorted(self._lives):
            life = self._lives[name]
            if self._consumed(life):
                continue  # NOTE [fresh in their step]: in the step's unmanaged figure
            life.unpin(n_steps - 1)  # still pinned when the iteration ended
            start = 0 if life.existed else min(life.start, n_steps - 1)
            tensors.append(
                TraceTensor(
                    vid=first_vid + len(tensors),
                    nbytes=life.nbytes,
                    dtypes=(life.dtype,),
                    saved_step=start,
                    evictable_step=start,
                    use_steps=tuple(sorted(u for u in life.uses if start <= u < n_steps)),
                    kind=life.kind,
                    name=name,
                    persistent=life.end is None,
                    whole=True,
                    dirty_step=life.dirty_step,
                )
            )
        return tensors
