"""One managed training iteration: routes hook events to the store and policy, keeps the books."""

import copy
import functools
import logging
import time

import torch

from vtensor.activations.recompute.profile.units import UnitRecorder
from vtensor.activations.replay.executor import PlanExecutor
from vtensor.activations.replay.lean import Passing, replays_hookless, replays_lean, wait_for_room
from vtensor.activations.runtime.admission import Admission
from vtensor.activations.runtime.floor import BudgetFloor
from vtensor.activations.runtime.live import LiveBytes
from vtensor.activations.runtime.param_side import ParamSide
from vtensor.activations.runtime.policy import ReactivePolicy
from vtensor.activations.runtime.recorder import IterationBooks, OpenStep
from vtensor.activations.store.chunk_store import ChunkStore, VTensor
from vtensor.measure.clock import device_now
from vtensor.measure.rss import RssMeter
from vtensor.measure.trackers import DeviceTracker
from vtensor.planner.reserves import MIN_BUDGET_MARGIN_BYTES

logger = logging.getLogger(__name__)


class Iteration:
    """The hook target of one ``MemoryManager.step``: hooks route its events here."""

    def __init__(
        self,
        store: ChunkStore,
        policy: ReactivePolicy,
        tracker: DeviceTracker,
        device: torch.device,
        protected_storages: set[int],
        baseline_bytes: int,
        min_tensor_bytes: int,
        record_trace: bool = False,
        executor: PlanExecutor | None = None,
        rss: RssMeter | None = None,
        count_workspaces: bool = False,
        params: ParamSide | None = None,
        lean: bool = False,
    ) -> None:
        self.store = store
        self.params = params  # NOTE [one plan] in vtensor/offload/joint.py
        # Above 0 while a forward runs again (NOTE [recompute]): module hooks then ignore it.
        self.recomputing = 0
        self._recompute_from: tuple[int, int] | None = None  # outermost: (reading, regrowth)
        self.units: UnitRecorder | None = None
        self.recomputed: tuple[str, ...] = ()
        self.encoded = False  # clamps saved bits (NOTE [mask encoding])
        self.policy = policy
        self.tracker = tracker
        self.device = device
        self.admission = Admission(device, protected_storages, min_tensor_bytes)
        self.baseline_bytes = baseline_bytes
        self.record_trace = record_trace
        self.own_time_excluded = record_trace and device.type == "cpu"  # NOTE [own time]
        self.executor = executor
        # NOTE [transient bytes] in runtime/recorder.py; it also keeps the RSS peak.
        self.rss = rss if record_trace or count_workspaces else None
        self.count_workspaces = count_workspaces
        self.rss_peak_bytes = 0
        # Allowed overshoot: one chunk (a whole tensor at tensor granularity cannot be bounded).
        self.overshoot_bytes = store.chunk_bytes or MIN_BUDGET_MARGIN_BYTES
        if params is not None:  # its tensors move whole, as at tensor granularity
            self.overshoot_bytes = max(self.overshoot_bytes, params.largest_bytes())
        self.meter = LiveBytes(tracker, store, device, baseline_bytes, params)
        self._entry_pool = tracker.pool_bytes()
        self.one_time_bytes = 0  # NOTE [MKL buffer pool]: measured when the iteration ends
        self.books = IterationBooks()
        self.floor = BudgetFloor(store, self.books, policy.budget_bytes, params)
        self.step_index = -1
        self._event = 0  # hook events of the open step so far (NOTE [step reserve])
        self._guarded_at: tuple[int, int] | None = None  # (step, event) the guard last acted at
        self._open: OpenStep | None = None
        self.meter.note(baseline_bytes)  # what a reading now gives: the entry reading is new
        self._backward_done_queued = False
        self.lean = replays_lean(  # NOTE [lean replay] in activations/replay/lean.py
            lean,
            executor,
            policy.budget_bytes,
            joint=params is not None,
            count_workspaces=count_workspaces,
            record_trace=record_trace,
        )
        self.was_lean, self.passing = self.lean, None  # passing: while lean (NOTE [passed])
        self.hookless = False  # NOTE [hookless replay]
        if self.lean:
            assert executor is not None
            self.hookless = replays_hookless(executor)
            read = functools.partial(self.check_boundary, "at a watched step's saved tensor")
            self.passing = Passing(store, executor, read if self.hookless else None)
            policy.follow_plan(True)
        self._lean_step = ""
        self.begin_step("other:start")

    def wired(self, recomputed: tuple[str, ...], units: UnitRecorder | None, encoded: bool) -> None:
        """What ``wiring.instrumented`` installed: recomputed modules, unit recorder, encoding."""
        self.recomputed, self.units, self.encoded = recomputed, units, encoded

    # -- measurement --------------------------------------------------------------------------
    def _step_name(self) -> str:
        return self._open.name if self._open is not None else self._lean_step or "start"

    def live_bytes(self) -> int:
        """Tracked device bytes now."""
        return self.meter.read()

    def _sample(self, live: int) -> None:
        if self.record_trace and self._guarded_at is not None:
            # NOTE [step reserve] in planner/reserves.py: the rise since the guard last acted.
            self.books.note_growth(self._guarded_at, self.meter.rise(live))
        if live > self.policy.budget_bytes + self.overshoot_bytes:
            # Broke before the policy could act: infeasible at this budget as run.
            self.books.violated = True
            self.floor.note_broken(live, self._step_name())
        self.books.peak_bytes = max(self.books.peak_bytes, live)
        if self._open is not None:
            self._open.peak = max(self._open.peak, live)
            if self.record_trace:
                unmanaged = live - self.store.device_bytes()
                if self.params is not None:
                    unmanaged -= self.params.traced_bytes()  # the plan places them
                self.books.note_unmanaged(self._open, unmanaged)

    def _next_event(self) -> None:
        """A hook event of the open step: the guard keeps what followed it in the profile."""
        self._event += 1
        self.policy.at_event(self._event)  # NOTE [step reserve] in planner/reserves.py

    # -- recomputation --------------------------------------------------------------------------
    def recompute_began(self, regrowth_bytes: int) -> None:
        """Without a plan, make room for ``regrowth_bytes`` (NOTE [recomputed growth]); note."""
        if self.recomputing != 1 or self.lean:
            return
        if regrowth_bytes and not (self.executor is not None and self.executor.active):
            # NOTE [regrowth bound]: the reading after it judges the budget.
            self.enforce(incoming_bytes=regrowth_bytes, judge=False)
        self._recompute_from = (self.live_bytes(), regrowth_bytes)

    def recompute_ended(self) -> None:
        """Its growth is the plan's to place, not headroom (NOTE [recomputed growth])."""
        if self.recomputing == 1 and self._recompute_from is not None:
            began, regrowth = self._recompute_from
            live = self.live_bytes()
            self.meter.announce_recomputed(live - began)
            # No hook reads inside it: its peak is where it began plus its working set (NOTE
            # [recomputation's working set]).
            self._sample(max(live, began + regrowth) if self.record_trace else live)
            self._recompute_from = None

    # -- hook target --------------------------------------------------------------------------
    def accepts(self, tensor: torch.Tensor, storage: torch.UntypedStorage) -> bool:
        """Whether a plain saved tensor (``admission.storage``) becomes a vTensor: not tiny."""
        if not self.admission.big_enough(storage):
            self.books.unmanaged_saved_bytes += tensor.nbytes
            return False
        return True

    def on_pack(self, record: VTensor, tensor: torch.Tensor) -> None:
        """Account a newly saved tensor and keep the budget."""
        if record.vid not in self.books.tensors:
            self.books.book(record)
            if self.executor is not None:
                self.executor.on_record(record)
        if self.lean:
            if self.executor is not None and self.executor.active:
                return  # NOTE [lean replay]
            self._leave_lean()
        self.books.dtypes.setdefault(record.vid, set()).add(str(tensor.dtype).replace("torch.", ""))
        self._next_event()
        self.enforce()

    def before_unpack(self, record: VTensor) -> None:
        """Make room for the bytes of ``record`` that must come back."""
        if self.lean:
            self.store.reap(block=False, block_restores=False)
            return  # the plan has made room (NOTE [lean replay])
        if self._open is not None:
            self._open.begin_part()  # where a backward node ended before (NOTE [backward parts])
        self._next_event()
        incoming = sum(c.nbytes for c in record.offloaded_chunks())
        resident = record.storage.nbytes() if record.storage is not None else 0
        if incoming and resident and not record.in_place:
            # NOTE [growing a partial vTensor]: on the copy path growing a storage reallocates
            # it, so prefix and full size coexist. Make room for the whole size, else send the
            # prefix out too (a write and a read traded for the transient).
            self.enforce(incoming_bytes=record.nbytes, pinned=record, judge=False)
            too_big = self.live_bytes() + record.nbytes > self.policy.budget_bytes
            if too_big and self.store.evictable(record):
                self.store.evict(record, resident)
                self.store.reap(block=True)
                incoming = sum(c.nbytes for c in record.offloaded_chunks())
        self.enforce(incoming_bytes=incoming, pinned=record)

    def after_unpack(self, record: VTensor) -> None:
        """Note the use and prefetch what backward needs next."""
        if self.lean:
            return  # the plan prefetches (NOTE [lean replay])
        if self.step_index not in record.uses:
            record.uses.append(self.step_index)
        self.books.unpacked(record.vid, self.step_index, self._open)
        self._next_event()
        live = self.live_bytes()
        self._sample(live)
        if (self.executor is None or not self.executor.active) and self.policy.prefetch(
            live, record
        ):
            live = self.live_bytes()
            self._sample(live)
        self.meter.note(live)

    def begin_step(self, name: str) -> None:
        """Close the open step and open the next one."""
        if self._step_name() == name and (self._open is not None or self.lean):
            return
        index = self.step_index + 1
        if name.startswith("backward:") and not self._backward_done_queued:
            # Optimizer work after backward is its own step: autograd runs this at graph end.
            self._backward_done_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        self._event = 0
        if self.lean and self._lean_begin(index, name):
            return  # else it left the plan: the step is opened again below, with the books
        self._close_step()
        self.step_index = index
        epoch = self.store.memory_epoch
        live = self.live_bytes()
        now = device_now(self.device) if self.record_trace else time.perf_counter()
        self._open = OpenStep(self.step_index, name, now, live, live, copy.copy(self.store.stats))
        if self.rss is not None:
            self.rss.reset_peak()
            self._open.rss_start = self.rss.current_rss_bytes()
        if self.executor is not None:
            if self.executor.active:  # what a lean replay waits for, a full one too
                wait_for_room(self.store, self.executor.plan, self.step_index)
            self.policy.at_plan_step(self.step_index, active=self.executor.active)
            self.executor.on_step(self.step_index, name, self.make_room)  # NOTE [room for restores]
            if not self.executor.active:
                self.policy.at_plan_step(self.step_index, active=False)
        if self.params is not None:
            reads = self.params.on_step(self.step_index)
            # The plan counts its write-backs as gone: before it reads more, and where those in
            # flight exceed the step's predicted headroom (NOTE [lean waits]), they are waited for.
            if reads or self.params.writing_bytes() > self._plan_headroom():
                self.params.settle()
            for entry in reads:
                self.make_room(entry.nbytes)
                self.params.read(entry)
        # NOTE [reused readings]: a heap-counter read walks every malloc arena's free chunks;
        # while no storage was resized or freed (``store.memory_epoch``), the last one holds.
        # The epoch does not count parameter reads, so a joint iteration always reads again.
        same = self.store.memory_epoch == epoch and self.params is None
        self.enforce(live_hint=live if same else None)

    def _plan_headroom(self) -> int:
        """What the followed plan predicts free at the running step (0 without one)."""
        if self.executor is None or not self.executor.active:
            return 0
        headroom = self.executor.plan.step_headroom_bytes
        return headroom[self.step_index] if self.step_index < len(headroom) else 0

    def after_node(self) -> None:
        """Sample a backward node's working set (NOTE [node peaks]); no eviction: it is allocated.

        The growth since the last hook point is headroom the policy must keep.
        """
        if self._open is not None:
            self._open.node_ended = True
        self.store.collect_off_owner()  # frees deferred on autograd's device thread (CUDA)
        self._next_event()
        live = self.live_bytes()
        self._sample(live)
        self.floor.note_growth(live, self.meter.growth(live), self.policy, self._step_name())
        self.policy.keep_reserve(self.meter.growth(live), self.meter.recomputed_bytes)
        self.floor.note(live, None, self._step_name(), self.step_index, strict=False)
        self.meter.note(live)

    def _backward_done(self) -> None:
        self._backward_done_queued = False
        self.begin_step("other:after-backward")

    # -- the budget ---------------------------------------------------------------------------
    def make_room(self, nbytes: int) -> None:
        """Evict activations so that ``nbytes`` about to be allocated fit (a read, a check)."""
        self.enforce(incoming_bytes=nbytes, judge=False)

    def room_bytes(self) -> int:
        """What the budget leaves beside the bytes the iteration began with."""
        return self.policy.budget_bytes - self.baseline_bytes

    def enforce(
        self,
        incoming_bytes: int = 0,
        pinned: VTensor | None = None,
        *,
        judge: bool = True,
        live_hint: int | None = None,
    ) -> None:
        """Keep tracked device bytes (plus ``incoming_bytes`` about to arrive) under the budget.

        ``pinned``: the vTensor about to be used; ``judge=False``: no feasibility recorded;
        ``live_hint``: a reading still valid (NOTE [reused readings]).
        """
        # NOTE [deterministic reaping]: wait here unless replaying.
        replaying = self.executor is not None and self.executor.active
        epoch = self.store.memory_epoch
        self.store.reap(block=not replaying, block_restores=False)
        if live_hint is None or self.store.memory_epoch != epoch:
            live = self.live_bytes()
        else:
            live = live_hint  # NOTE [reused readings]
        self._sample(live)
        self.floor.note_growth(live, self.meter.growth(live), self.policy, self._step_name())
        self.policy.keep_reserve(self.meter.growth(live), self.meter.recomputed_bytes)
        epoch = self.store.memory_epoch
        self.policy.enforce(live + incoming_bytes, pinned)
        if self.store.memory_epoch != epoch or self.params is not None:
            live = self.live_bytes()  # else nothing was freed or grown since the read above
        if live + incoming_bytes > self.policy.high_watermark():
            self.store.reap(block=True)
            self.policy.evict_down_to(
                self.live_bytes() + incoming_bytes, self.policy.high_watermark(), pinned
            )
            self.store.reap(block=True)
            live = self.live_bytes()
        if self.params is not None and live + incoming_bytes > self.policy.high_watermark():
            self.params.shed(live + incoming_bytes - self.policy.high_watermark())
            live = self.live_bytes()
        if judge:
            self.floor.note(live + incoming_bytes, pinned, self._step_name(), self.step_index)
        self.meter.note(live)
        self.meter.mark(live)
        self._guarded_at = (self.step_index, self._event)

    # -- lean replay (NOTE [lean replay]) ------------------------------------------------------
    def _lean_begin(self, index: int, name: str) -> bool:
        """Step ``index`` named ``name`` of a lean replay begins; False: it left the plan."""
        executor = self.executor
        assert executor is not None
        self._lean_step = name
        self.step_index = index
        wait_for_room(self.store, executor.plan, index)  # NOTE [lean waits]
        executor.on_step(index, name)
        # At a boundary, the headroom its full replays kept there (NOTE [step reserve]).
        self.policy.at_step(index, following=executor.active)
        if not executor.active:
            self._leave_lean()
            return False
        if index in executor.watched:
            self.check_boundary()
        return True

    def check_boundary(self, where: str = "") -> None:
        """A lean replay's reading at a module boundary, or ``where``."""
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

    def _leave_lean(self) -> None:
        self.lean = False
        self.passing = None
        self.policy.follow_plan(self.executor is not None and self.executor.active)

    # -- closing ------------------------------------------------------------------------------
    def _close_step(self) -> None:
        step = self._open
        if step is None:
            return
        transient = 0
        if self.rss is not None:
            high_water = self.rss.peak_rss_bytes()
            self.rss_peak_bytes = max(self.rss_peak_bytes, high_water)
            transient = step.transient_bytes(
                high_water, self.rss.current_rss_bytes(), self.live_bytes()
            )
            if self.count_workspaces:
                self.policy.keep_transient(transient)
        self.books.close(step, self.store.stats, transient, counted=self.count_workspaces)
        self._open = None

    def finish(self) -> None:
        """Close the last step; measure the process memory the iteration kept for good."""
        self._close_step()
        self.one_time_bytes = max(0, self.tracker.pool_bytes() - self._entry_pool)

    def exclude_time(self, seconds: float) -> None:
        """Leave ``seconds`` (the profiler's own work) out of the open step's duration."""
        if self._open is not None:
            self._open.started += seconds
