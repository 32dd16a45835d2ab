"""Replays a swap plan at step boundaries, and notices when the run diverges from its trace."""

import logging
from collections import defaultdict
from collections.abc import Callable

from vtensor.activations.store.chunk_store import ChunkStore, VTensor
from vtensor.planner.plan import Plan, TensorMove

logger = logging.getLogger(__name__)

# NOTE [room for restores]
# A plan that fills the budget predicts each step's bytes only within the heap counter's noise,
# and its restores start as the step begins, before any reading: a restore the noise left no room
# for lands over the budget before the guard can act. A full replay therefore makes room for each
# restore first (``Iteration.make_room``), as for a parameter read. A lean replay does not: its
# plan was proven by a full replay that needed no guard.


class PlanExecutor:
    """Issues a plan's evictions and prefetches at their steps; gives up at the first divergence.

    vTensors are matched to the plan by position (order of first save) and size; steps by
    position and name. Any mismatch sets ``diverged`` and stops the replay: the reactive policy
    keeps the budget for the rest of the iteration.
    """

    def __init__(
        self, plan: Plan, store: ChunkStore, *, wait_early_evictions: bool = False
    ) -> None:
        self.plan = plan
        self.store = store
        # NOTE [eviction timing]: True when the plan budgets op workspaces.
        self.wait_early_evictions = wait_early_evictions
        # By plan position; None: passed to autograd (NOTE [passed]).
        self.records: dict[int, VTensor | None] = {}
        self.placed = 0  # saved storages placed so far
        self.diverged: str | None = None
        self.issued_bytes = 0  # bytes of the evictions it issued (the guard's come on top)
        self._started: set[tuple[int, int]] = set()  # (vid, planned step) started a step early
        self._evictions: dict[int, list[TensorMove]] = defaultdict(list)
        self._prefetches: dict[int, list[TensorMove]] = defaultdict(list)
        self._count = plan.activation_count  # the parameter side is the JointSide's
        self.watched = frozenset(plan.watched_steps)  # NOTE [lean replay]
        self.moved = frozenset(m.vid for m in plan.moves if m.vid < self._count)
        for move in plan.moves:
            if move.vid >= self._count:
                continue
            self._evictions[move.evict_step].append(move)
            self._prefetches[move.prefetch_step].append(move)

    @property
    def active(self) -> bool:
        """True while the run follows the plan."""
        return self.diverged is None

    def diverge(self, why: str) -> None:
        """The run left the plan (``why``): stop replaying it for the rest of the iteration."""
        if self.diverged is None:
            self.diverged = why
            logger.info("run diverged from its plan (%s); reactive policy for this iteration", why)

    def next_position(self) -> int:
        """The plan position of the next storage saved for the first time."""
        return self.placed

    def on_record(self, record: VTensor) -> None:
        """A vTensor was saved for the first time in this iteration."""
        self._place(record, record.nbytes)

    def passes_next(self, nbytes: int) -> bool:
        """Whether the next new saved storage (``nbytes``) is left to autograd (NOTE [passed])."""
        if self.next_position() in self.moved:
            return False
        self._place(None, nbytes)
        return self.active

    def _place(self, record: VTensor | None, nbytes: int) -> None:
        position = self.next_position()
        self.placed += 1
        self.records[position] = record
        if position >= self._count or self.plan.tensor_bytes[position] != nbytes:
            want = self.plan.tensor_bytes[position] if position < self._count else "none"
            self.diverge(f"saved tensor {position} has {nbytes} bytes, plan: {want}")

    def on_step(
        self, index: int, name: str, make_room: Callable[[int], None] | None = None
    ) -> None:
        """Step ``index`` named ``name`` begins: issue its moves (NOTE [room for restores])."""
        if not self.active:
            return
        names = self.plan.step_names
        if index >= len(names) or names[index] != name:
            self.diverge(
                f"step {index} is {name!r}, plan: "
                f"{names[index] if index < len(names) else 'none'!r}"
            )
            return
        # NOTE [eviction timing]: the plan counts an eviction's bytes as gone from its step on.
        # The next step's evictions start now so their writes overlap this step; those not
        # started early are written now and waited for. An early write still running is not
        # waited for: its bytes count as live, which the guard sees. A plan that budgets op
        # workspaces has given those bytes to a workspace no sample sees, so it waits for them.
        blocking = False
        for move in self._evictions.get(index, ()):
            if (move.vid, index) in self._started:
                record = self._record(move)
                pending = record.pending if record is not None else None
                if self.wait_early_evictions and pending is not None and pending.outgoing:
                    blocking = True
                continue
            record = self._record(move)
            if record is not None and self.store.evictable(record):  # else still in use
                self.issued_bytes += self.store.evict(record, move.evict_bytes)
                blocking = True
        if blocking:
            self.store.reap(block=True)
        for move in self._evictions.get(index + 1, ()):
            record = self._record(move)
            if record is not None and self.store.evictable(record):
                self.issued_bytes += self.store.evict(record, move.evict_bytes)
                self._started.add((move.vid, index + 1))
        for move in self._prefetches.get(index, ()):
            record = self._record(move)
            if record is not None and record.offloaded_chunks():
                if make_room is not None:
                    make_room(sum(c.nbytes for c in record.offloaded_chunks()))
                self.store.restore(record)

    def _record(self, move: TensorMove) -> VTensor | None:
        record = self.records.get(move.vid)
        return None if record is None or record.dead else record
