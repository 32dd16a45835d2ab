"""One plan for activations and parameter offloading: record the parameter side, replay it.

NOTE [one plan]
``mm.step(model, inputs=..., params=po)`` runs a ``MemoryManager`` iteration and a
``ParamOffload`` session under the manager's one budget. While an iteration is profiled, a
:class:`ParamRecorder` listens to the offload pool and records, per parameter-side tensor
(parameter, optimizer state, gradient, by name), the steps of the manager's trace at which a use
held it in memory, when it was created and whether it outlives the iteration; these become
``TraceTensor``s next to the saved activations (``kind`` not ``"activation"``, moved ``whole``),
and the trace's unmanaged bytes no longer include them. The LGM planner then decides for all of
them together which bytes are away at which step; it needs no other change, because it only
sees sizes, lifetimes and uses. A :class:`ParamPlanExecutor` replays the parameter side of the
plan: it keeps in memory between uses what the plan has resident (the pool's default is to let
every tensor go after its use), lets go of a tensor at its planned eviction step (a drop when
its tier copy is current, else a write) and starts its read at the planned prefetch step.
Activations are replayed by ``PlanExecutor`` as before. Every read the pool starts is announced
to the manager first, which makes room under the shared budget by evicting activations.

A plan of the parameter side only guides: the pool still pins what a use needs and reads it on
demand, so a parameter the plan did not foresee costs a wait, never a wrong value; and the pool
never holds more than the budget, whatever the plan says.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from vtensor.executor import PlanExecutor
from vtensor.offloaded import OffloadedTensor
from vtensor.param_pool import OffloadPool
from vtensor.plan import Plan
from vtensor.trace import TraceTensor

INCOMPLETE_KEY = "incomplete"  # trace meta: not a steady-state iteration, plan from a later one


def tensor_kind(name: str) -> str:
    """``"param"``, ``"grad"`` or ``"state"`` from a pool entry's name."""
    if "#grad" in name:
        return "grad"
    if "#state" in name:
        return "state"
    return "param"


@dataclass
class _Life:
    """What the recorder learns about one parameter-side tensor in one iteration."""

    nbytes: int
    dtype: str
    start: int
    existed: bool
    uses: set[int] = field(default_factory=set)
    pinned_at: int = -1
    end: int | None = None  # step at which it was forgotten
    dirty_step: int = -1


class ParamRecorder:
    """Listens to an ``OffloadPool`` during a profiled iteration (NOTE [one plan])."""

    def __init__(self, pool: OffloadPool) -> None:
        self.pool = pool
        self.step = 0
        self.created_state = False
        self._lives: dict[str, _Life] = {}
        for entry in pool.tensors:
            if not pool.is_fixed(entry):
                self._lives[entry.name] = self._life(entry, start=0, existed=True)

    @staticmethod
    def _life(entry: OffloadedTensor, start: int, existed: bool) -> _Life:
        dtype = str(entry.tensor.dtype).replace("torch.", "")
        return _Life(entry.nbytes, dtype, start, existed)

    # -- pool listener --------------------------------------------------------------------
    def adopted(self, entry: OffloadedTensor) -> None:  # noqa: D102
        if self.pool.is_fixed(entry):
            return
        if tensor_kind(entry.name) == "state":
            self.created_state = True  # a first update: later iterations will differ
        self._lives[entry.name] = self._life(entry, start=max(self.step, 0), existed=False)

    def used(self, entry: OffloadedTensor) -> None:  # noqa: D102
        life = self._lives.get(entry.name)
        if life is not None:
            if entry.pins == 0:
                life.pinned_at = self.step
            life.uses.add(self.step)

    def released(self, entry: OffloadedTensor) -> None:  # noqa: D102
        life = self._lives.get(entry.name)
        if life is None:
            return
        now = self.step
        if entry.pins == 0 and life.pinned_at >= 0:
            # Held through every step from its pin to now: each is a use.
            life.uses.update(range(life.pinned_at, now + 1))
            life.pinned_at = -1
        if not entry.clean:
            life.dirty_step = now

    def forgotten(self, entry: OffloadedTensor) -> None:  # noqa: D102
        life = self._lives.get(entry.name)
        if life is not None:
            now = self.step
            if life.pinned_at >= 0:
                life.uses.update(range(life.pinned_at, now + 1))
                life.pinned_at = -1
            life.uses.add(now)
            life.end = now

    def holds(self, entry: OffloadedTensor) -> bool:  # noqa: D102
        return False  # profiling: the pool's own policy decides

    # -- the iteration ----------------------------------------------------------------------
    def on_step(self, index: int) -> None:
        """Step ``index`` begins (nothing to replay while profiling)."""
        self.step = index

    def resident_bytes(self) -> int:
        """Bytes of movable parameter-side tensors in memory (the trace plans them)."""
        return self.pool.meter.resident_bytes - self.pool.fixed_bytes

    def trace_tensors(self, first_vid: int, n_steps: int) -> list[TraceTensor]:
        """The recorded tensors as trace tensors, by name, numbered from ``first_vid``."""
        tensors: list[TraceTensor] = []
        for name in sorted(self._lives):
            life = self._lives[name]
            now = n_steps - 1
            if life.pinned_at >= 0:  # still pinned when the iteration ended
                life.uses.update(range(life.pinned_at, now + 1))
            uses = tuple(sorted(u for u in life.uses if 0 <= u < n_steps))
            start = 0 if life.existed else min(life.start, n_steps - 1)
            tensors.append(
                TraceTensor(
                    vid=first_vid + len(tensors),
                    nbytes=life.nbytes,
                    dtypes=(life.dtype,),
                    saved_step=start,
                    evictable_step=start,
                    use_steps=tuple(u for u in uses if u >= start),
                    kind=tensor_kind(name),
                    name=name,
                    persistent=life.end is None,
                    whole=True,
                    dirty_step=life.dirty_step,
                )
            )
        return tensors


class ParamPlanExecutor:
    """Replays the parameter side of a joint plan through an ``OffloadPool`` (NOTE [one plan]).

    ``active()`` is the activation replay's state: once the run diverges from the plan, the
    pool's own policy takes over again.
    """

    def __init__(self, plan: Plan, pool: OffloadPool, active: Callable[[], bool]) -> None:
        self.plan = plan
        self.pool = pool
        self._active = active
        self.step = -1
        self.missed = 0
        n = len(plan.step_names)
        self._vids = {name: vid for vid, name in enumerate(plan.tensor_names) if name}
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
        if not self._active() or entry.name not in self._vids:
            return False
        return not self._away(entry.name, self.step)

    # -- the iteration ----------------------------------------------------------------------
    def on_step(self, index: int) -> None:
        """Step ``index`` begins: let go of and read what the plan says for it."""
        self.step = index
        if not self._active():
            return
        evict, fetch = self._evict.get(index, []), self._fetch.get(index, [])
        if not evict and not fetch and index != 0:
            return
        entries = self._entries()
        for name in evict:
            entry = entries.get(name)
            if entry is None or not entry.in_memory:
                continue
            if entry.pins or entry.wanted:
                self.missed += 1
            self.pool.let_go(entry)
        if index == 0:
            # The first iteration under this plan may start with tensors the pool's own policy
            # let go of but the plan has resident: bring them in as the plan assumes.
            fetch = [n for n in self._vids if n in entries and not self._away(n, 0)]
        for name in fetch:
            entry = entries.get(name)
            if entry is not None:
                self.pool.fetch_held(entry)

    def resident_bytes(self) -> int:
        """Bytes of movable parameter-side tensors in memory."""
        return self.pool.meter.resident_bytes - self.pool.fixed_bytes

    def trace_tensors(self, first_vid: int, n_steps: int) -> list[TraceTensor]:
        """Nothing: a replayed iteration is not traced."""
        return []


def param_side(
    pool: OffloadPool, executor: PlanExecutor | None, *, record: bool
) -> ParamRecorder | ParamPlanExecutor | None:
    """The parameter side of a joint iteration.

    It replays the plan the activations replay, records a profiled iteration, or (reactive)
    leaves the pool's own policy be.
    """
    if executor is not None:
        return ParamPlanExecutor(executor.plan, pool, lambda: executor.active)
    return ParamRecorder(pool) if record else None


def held_outside(pool: OffloadPool, model: nn.Module) -> int:
    """Bytes the pool holds in memory that are not the model's parameters (optimizer state)."""
    model_storages = {p.untyped_storage()._cdata for p in model.parameters()}
    return sum(
        e.nbytes for e in pool.tensors if e.in_memory and e.storage._cdata not in model_storages
    )
