"""Whether a replayed plan is followed lean: per-tensor work only where the plan acts.

NOTE [lean replay]
A replayed plan that this process measured in full while profiling is followed with per-tensor
work only where the plan acts: hook points inside a module (saves, unpacks, backward nodes)
route to the store and the plan, and the tracked bytes are read, and the guard acts, at the
module boundaries the plan watches only (``Plan.watched_steps``): its predicted peak's, and of
those it predicts near the budget, where it predicts more than the last reading confirmed (NOTE
[confirmed readings] in ``planner/memory_model.py``). The profiled iteration judged every hook
point and backward node; the replay repeats it (the executor checks every saved tensor's size
and every step's name, and a divergence turns the checks back on for the rest of the
iteration). A boundary reading over the budget also turns them back on, and the plan is
profiled again next time: a lean iteration cannot state a minimum budget of its own (it has not
judged every point), so it reports the profiled iteration's. A plan replays lean only once a
full replay of it needed nothing from the guard (no eviction beyond the plan's): where the guard
helps, it helps between boundaries too (``PlanBook``). With a plan cache, that full replay is
noted beside the cached plan (by the plan's digest, ``PlanCache.mark_lean``), and the next
managers that load the plan, in this process or another, replay it lean from their first
iteration: the main job opens a manager per round, whose first iteration was a full replay.

NOTE [lean waits]
No guard reads the bytes between a lean replay's boundaries, so the boundaries are what keeps
compute from running ahead of the writes: an eviction's bytes count as gone from its step on
(NOTE [eviction timing]), and a write still in flight holds them. The plan knows, per step, how
far under its budget it predicts the step (``Plan.step_headroom_bytes``), and its budget is
itself the guard's headroom under the manager's (``replays_lean``). So as a step begins, a lean
replay waits for the writes only where those in flight hold more than that step's headroom: the
step then stays within the plan's budget, with the guard's headroom to spare, as a full
replay's guard would keep it. Waiting at every boundary, lean replays stalled where full replays did
not (a full replay's guard waits only once the headroom is gone); with this rule MobileNetV2's
lean replays at 80-50 % stall 0.000 s (benchmarks/HISTORY.md, 2026-12-02). Waiting nowhere, the
main job's two clients sharing two cores, whose writes fell behind compute, went up to 70 %
over budget in lean replays. A full replay waits by the same rule: its guard sees the writes
in flight, but keeps only the headroom of the point it acts at (NOTE [step reserve]), while
the plan has given the bytes it counted as gone to the step, where a recomputation brings a
module's saved tensors back at once between two points.

NOTE [passed]
A lean replay leaves to autograd, as it is, every saved storage its plan never moves: no
vTensor, no alias, no record to free, so per-tensor work is done only where the plan acts. Its
position among the iteration's first saves and its size are still matched with the plan's (a
storage seen again, found by a weak reference that holds no memory, keeps its first position),
and unpacking it still checks that it was not modified in place after saving. What this gives
up: where the replay stops following the plan (a divergence, a reading over the budget), the
guard that takes over can evict only the storages saved as vTensors.

NOTE [hookless replay]
A lean replay of a plan that moves no activation (a budget that never binds, or one that
recomputation or encoding alone meets) has nothing to do at module boundaries but read the
tracked bytes at the steps it watches: it installs no module hooks at all, so the model's
modules run on torch's path without hooks. Saved tensors are still matched with the plan by
position and size (NOTE [passed]), and the tracked bytes are read at the first saved-tensor
event at or after each watched step (``Plan.watched_events``) instead of at that step's
boundary: the same readings, among them the one that states the iteration's peak, each a little
later in its step. A plan with a watched step that no event follows keeps its module hooks. A
reading over the budget turns the checks back on, at the saved-tensor hooks only, and the plan
is profiled again next time. Module hooks at every boundary cost the main job's CNN, whose
step is short, more than a tenth of its step (benchmarks/README.md, ``main_round``).
"""

from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from vtensor.activations.replay.executor import PlanExecutor
from vtensor.activations.store.chunk_store import ChunkStore
from vtensor.planner.plan import Plan
from vtensor.planner.reserves import planned_headroom


class Passing:
    """The saved storages a lean replay leaves to autograd (NOTE [passed])."""

    def __init__(
        self, store: ChunkStore, executor: PlanExecutor, read: Callable[[], None] | None
    ) -> None:
        self.store = store
        self.executor = executor
        self._seen: dict[int, tuple[StorageWeakRef, int]] = {}
        # NOTE [hookless replay]: without module hooks, the bytes are read at these events.
        self._read = read
        self._events = set(executor.plan.watched_events) if read is not None else set()
        self.reading = bool(self._events)  # readings left to take

    def _at(self, event: tuple[int, int]) -> None:
        if event in self._events and self._read is not None:
            self._events.discard(event)  # a storage's first save or unpack only
            self.reading = bool(self._events)
            self._read()

    def unpacked(self, position: int) -> None:
        """Backward has the tensor at ``position``, left to autograd."""
        self._at((position, 1))

    def passes(self, storage: torch.UntypedStorage) -> int | None:
        """The plan position of a saved ``storage`` if it is left to autograd, else None.

        A storage seen for the first time is placed in the plan. None once the run has left
        the plan.
        """
        executor = self.executor
        if not executor.active or (self.store.records and self.store.known(storage)):
            return None
        seen = self._seen.get(storage._cdata)
        if seen is not None and not seen[0].expired():  # type: ignore[no-untyped-call]
            return seen[1]
        position = executor.next_position()
        if not executor.passes_next(storage.nbytes()):
            return None  # a vTensor; past a divergence the iteration leaves the lean replay
        self._seen[storage._cdata] = (StorageWeakRef(storage), position)  # type: ignore[no-untyped-call]
        if self.reading:
            self._at((position, 0))
        return position


def wait_for_room(store: ChunkStore, plan: Plan, step_index: int, room: int | None = None) -> None:
    """As step ``step_index`` of a replay begins, wait for the writes beyond its headroom.

    NOTE [lean waits], for full replays as well; completed transfers are taken in either way.
    ``room``: the bytes that may stay in flight, where not the step's headroom (a sparse
    replay's, NOTE [sparse replay]).
    """
    store.reap(block=False, block_restores=False)
    if room is None:
        headroom = plan.step_headroom_bytes
        room = headroom[step_index] if step_index < len(headroom) else 0
    if store.outgoing_bytes() > room:
        store.reap(block=True, block_restores=False)


def replays_hookless(executor: PlanExecutor) -> bool:
    """Whether a lean replay of ``executor``'s plan needs no module hooks.

    NOTE [hookless replay]: a plan that moves no activation and can read at every step it
    watches.
    """
    plan = executor.plan
    nothing_moves = not any(m.vid < plan.activation_count for m in plan.moves)
    return nothing_moves and bool(plan.watched_events)


def replays_lean(
    asked: bool,
    executor: PlanExecutor | None,
    budget_bytes: int,
    *,
    joint: bool,
    count_workspaces: bool,
    record_trace: bool,
) -> bool:
    """Whether an iteration replays ``executor``'s plan lean (``asked``: its plan book allows).

    Only a plan that leaves the guard its headroom under ``budget_bytes`` (``leaves_headroom``):
    where the plan fills the whole budget, the guard acts between boundaries as well. Or a plan
    that moves nothing and whose guard kept each point's own headroom (NOTE [step reserve] in
    ``planner/reserves.py``): a full replay of it that needed no guard (``asked``) is the same
    computation as its lean replays, and the guard would have nothing to move. Never under a
    joint plan with parameter offloading, with op workspaces counted, or while profiling: those
    read the tracked bytes at every point.
    """
    if not asked or executor is None or joint or count_workspaces or record_trace:
        return False
    plan = executor.plan
    if not plan.moves and plan.step_reserve_bytes:
        return plan.budget_bytes <= budget_bytes
    return leaves_headroom(plan, budget_bytes)


def leaves_headroom(plan: Plan, budget_bytes: int) -> bool:
    """Whether ``plan`` leaves the guard its headroom under ``budget_bytes``.

    NOTE [plan within the guard] in ``activations/plan/guarded.py``, NOTE [planned headroom] in
    ``planner/reserves.py``.
    """
    reserves = () if plan.tensor_names else plan.step_reserve_bytes  # joint: the one reserve
    headroom = planned_headroom(reserves, plan.reserve_bytes, plan.chunk_bytes)
    return plan.budget_bytes + headroom <= budget_bytes
