"""A lean replay's side of an iteration: its steps' moves and waits, and its readings.

NOTE [lean replay] in ``activations/lean.py``, NOTE [sparse replay] in ``activations/sparse.py``.
"""

import logging
from abc import ABC, abstractmethod

from vtensor.activations.executor import PlanExecutor
from vtensor.activations.lean import Passing, wait_for_room
from vtensor.activations.live import LiveBytes
from vtensor.activations.policy import ReactivePolicy
from vtensor.activations.quiet import QuietTurns
from vtensor.activations.recorder import IterationBooks
from vtensor.activations.sparse import SparseBoundaries
from vtensor.activations.store import ChunkStore
from vtensor.activations.windows import SaveLog, SaveWindows

logger = logging.getLogger(__name__)


class LeanSteps(ABC):
    """The lean replay's methods of ``Iteration``, which holds the state named here."""

    store: ChunkStore
    policy: ReactivePolicy
    executor: PlanExecutor | None
    books: IterationBooks
    meter: LiveBytes
    lean: bool
    passing: Passing | None
    step_index: int
    _lean_step: str
    _turns: QuietTurns | None
    sparse: SparseBoundaries | None
    save_log: SaveLog | None

    @abstractmethod
    def live_bytes(self) -> int:
        """Tracked device bytes now (``Iteration.live_bytes``)."""

    @abstractmethod
    def _sample(self, live: int) -> None:
        """Take ``live`` into the books (``Iteration._sample``)."""

    @abstractmethod
    def enforce(self, *, live_hint: int | None = None) -> None:
        """Keep the tracked bytes under the budget (``Iteration.enforce``)."""

    def _lean_begin(self, index: int, name: str) -> bool:
        """Step ``index`` named ``name`` of a lean replay begins; False: it left the plan."""
        executor = self.executor
        assert executor is not None
        self._lean_step = name
        self.step_index = index
        room = self.sparse.rooms.get(index) if self.sparse is not None else None
        wait_for_room(self.store, executor.plan, index, room)  # NOTE [lean waits]
        watched = index in (executor.watched if self.sparse is None else self.sparse.watched)
        executor.on_step(index, name)
        # At a boundary, the headroom its full replays kept there (NOTE [step reserve]).
        self.policy.at_step(index, following=executor.active)
        if not executor.active:
            self._leave_lean()
            return False
        if watched:
            self.check_boundary()
        return True

    def check_boundary(self, where: str = "") -> None:
        """A lean replay's reading at a module boundary (NOTE [lean replay]), or ``where``."""
        live = self.live_bytes()
        self._sample(live)
        # Growth over many steps: no headroom to keep between hook points (the plan's stands).
        self.meter.note(live)
        if self.books.violated:
            logger.warning(
                "a replayed plan went over the budget at step %r (%d bytes of %d): checking "
                "every hook point from here on, and profiling again next iteration",
                where or self._lean_step,
                live,
                self.policy.budget_bytes,
            )
            self._leave_lean()
            self.enforce(live_hint=live)
        elif live > self.policy.high_watermark():
            self.enforce(live_hint=live)

    def leave_plan(self, why: str) -> None:
        """The run left the plan where no saved tensor or step name showed it (a sparse replay)."""
        if self.executor is not None:
            self.executor.diverge(why)
        if self.lean:
            self._leave_lean()

    def sparse_ended(self, sparse: SparseBoundaries) -> None:
        """Backward is done: a sparse replay whose run saved fewer tensors left its plan.

        So did one that never reached one of its acting steps.
        """
        executor = self.executor
        if executor is not None and executor.active:
            saved, count = executor.placed, executor.expected
            missed = sparse.missed()
            if saved < count:
                self.leave_plan(f"{saved} tensors saved, plan: {count}")
            elif missed:
                names = executor.plan.step_names
                name = names[missed[0]] if missed[0] < len(names) else "?"
                self.leave_plan(f"step {missed[0]} ({name}) never reached")
        sparse.after_backward()

    def prove_sparse(self, sparse: SparseBoundaries) -> None:
        """Tell the turns what a check found of ``sparse``'s counting (NOTE [sparse replay]).

        A check that left the plan (or broke off) proves nothing, unless an index disagreed.
        With it go the windows its saves found (NOTE [windowed saves]), where every saved
        storage was placed.
        """
        executor, turns = self.executor, self._turns
        if executor is None or turns is None:
            return
        followed = self.lean and executor.active
        if sparse.mismatch or followed:
            log = self.save_log
            whole = followed and log is not None and executor.placed == executor.expected
            windows = log.windows() if whole and log is not None else None
            turns.prove(executor, sparse.proven(self.step_index), windows)

    def windows(self) -> SaveWindows | None:
        """Where this sparse replay pushes its saved-tensor hooks (NOTE [windowed saves])."""
        executor, turns = self.executor, self._turns
        if executor is None or turns is None or self.passing is None:
            return None
        return turns.windows(executor)

    def _leave_lean(self) -> None:
        self.lean = False
        self.passing = None
        self.policy.follow_plan(self.executor is not None and self.executor.active)
