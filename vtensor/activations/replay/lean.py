"""Whether a replayed plan is followed lean: per-tensor work only where the plan acts.

NOTE [lean replay]
A plan this process (or the plan cache) saw replayed in full without the guard acting is followed
lean: hook points inside a module route only to the store and the plan, and the tracked bytes are
read, and the guard acts, only at the boundaries the plan watches (``Plan.watched_steps``; NOTE
[confirmed readings] in ``planner/memory_model.py``). The executor still checks every saved
tensor's size and every step's name; a divergence or a reading over the budget turns the checks
back on and the plan is profiled again. A lean iteration has not judged every point, so it reports
the profiled iteration's minimum budget.

NOTE [lean waits]
Between a lean replay's boundaries no guard reads the bytes, and a write in flight still holds the
bytes the plan counts as gone (NOTE [eviction timing]). So as a step begins, the replay waits for
writes only where those in flight exceed the step's predicted headroom
(``Plan.step_headroom_bytes``): waiting everywhere stalls, waiting nowhere lets compute run past
the budget. Full replays wait by the same rule: their guard keeps only the headroom of the point
it acts at (NOTE [step reserve]).

NOTE [passed]
A lean replay leaves every saved storage its plan never moves to autograd as it is (no vTensor, no
record), so per-tensor work happens only where the plan acts. Its position and size are still
matched with the plan's (a weak reference finds a storage seen again) and unpacking still checks
it was not modified in place. The price: a guard that takes over after a divergence can evict only
the storages saved as vTensors.

NOTE [passed storages seen again]
A storage saved again is found by its address and data pointer, with no reference to it: autograd
holds every saved storage until backward uses it, so in the meantime an address names one
storage. Where one is freed and its address reused (a recomputation in backward), the size the
plan expects next does not match and the replay leaves the plan, as at any divergence. A
reference kept here would keep each storage's C++ object allocated until the step ends (a
``StorageWeakRef`` does): small blocks among the freed tensors' memory, whose release at once lets
the allocator trim its heap, for the next step to fault back in page by page.

NOTE [hookless replay]
A lean replay of a plan that moves no activation installs no module hooks: it reads the tracked
bytes at the first saved-tensor event at or after each watched step (``Plan.watched_events``), the
same readings a little later in their step. Module hooks at every boundary cost a short-stepped
model a noticeable share of its step. A plan with a watched step that no event follows keeps its
module hooks; a reading over the budget turns the checks back on at the saved-tensor hooks.
"""

from collections.abc import Callable

import torch

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
        self._seen: dict[int, tuple[int, int]] = {}  # address -> (data pointer, position)
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
        """The plan position of a saved ``storage`` left to autograd (placed if new), else None."""
        executor = self.executor
        if not executor.active or (self.store.records and self.store.known(storage)):
            return None
        seen = self._seen.get(storage._cdata)
        if seen is not None and seen[0] == storage.data_ptr():
            return seen[1]
        position = executor.next_position()
        if not executor.passes_next(storage.nbytes()):
            return None  # a vTensor; past a divergence the iteration leaves the lean replay
        self._seen[storage._cdata] = (storage.data_ptr(), position)
        if self.reading:
            self._at((position, 0))
        return position


def wait_for_room(store: ChunkStore, plan: Plan, step_index: int, room: int | None = None) -> None:
    """As step ``step_index`` of a replay begins, wait for the writes beyond its headroom.

    NOTE [lean waits]; completed transfers are taken either way. ``room``: the bytes that may
    stay in flight, where not the step's headroom.
    """
    store.reap(block=False, block_restores=False)
    if room is None:
        headroom = plan.step_headroom_bytes
        room = headroom[step_index] if step_index < len(headroom) else 0
    if store.outgoing_bytes() > room:
        store.reap(block=True, block_restores=False)


def replays_hookless(executor: PlanExecutor) -> bool:
    """Whether ``executor``'s lean replay needs no module hooks (NOTE [hookless replay])."""
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

    A plan must leave the guard its headroom (``leaves_headroom``), else the guard acts between
    boundaries too; or move nothing with per-point reserves (NOTE [step reserve]), where the guard
    would have nothing to move. Never with a joint plan, counted workspaces or while profiling:
    those read the bytes at every point.
    """
    if not asked or executor is None or joint or count_workspaces or record_trace:
        return False
    plan = executor.plan
    if not plan.moves and plan.step_reserve_bytes:
        return plan.budget_bytes <= budget_bytes
    return leaves_headroom(plan, budget_bytes)


def leaves_headroom(plan: Plan, budget_bytes: int) -> bool:
    """Whether ``plan`` leaves the guard room (NOTE [plan within the guard])."""
    headroom = planned_headroom(plan.step_reserve_bytes, plan.reserve_bytes, plan.chunk_bytes)
    return plan.budget_bytes + headroom <= budget_bytes
