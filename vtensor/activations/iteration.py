"""One managed training iteration: routes hook events to the store and policy, keeps the books."""

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from vtensor.activations.executor import PlanExecutor
from vtensor.activations.floor import MIN_BUDGET_MARGIN_BYTES, BudgetFloor
from vtensor.activations.policy import ReactivePolicy
from vtensor.activations.recorder import IterationBooks, OpenStep
from vtensor.activations.store import ChunkStore, StoreStats, VTensor
from vtensor.activations.units import UnitRecorder
from vtensor.measure.rss import RssMeter
from vtensor.measure.trackers import DeviceTracker
from vtensor.planner.trace import Trace, TraceTensor, TraceUnit

logger = logging.getLogger(__name__)

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


class PlannedRead(Protocol):
    """A tensor of the parameter side that a joint plan reads at a step."""

    nbytes: int


class ParamSide(Protocol):
    """The parameter offloading that shares the iteration's budget (``offload/joint.py``)."""

    def on_step(self, index: int) -> Sequence[PlannedRead]:
        """Step ``index`` begins; returns the reads the plan starts now, in order."""
        ...

    def read(self, entry: Any) -> None:
        """Start one read that :meth:`on_step` returned (room was made for it)."""
        ...

    def resident_bytes(self) -> int:
        """Bytes of its movable tensors in memory now."""
        ...

    def trace_tensors(self, first_vid: int, n_steps: int) -> list[TraceTensor]:
        """Its tensors as trace tensors (profiling), numbered from ``first_vid``."""
        ...


class Iteration:
    """The hook target of one ``MemoryManager.step`` (``vtensor.activations.hooks.HookTarget``)."""

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
        # Above 0 while a forward runs again (NOTE [recompute] in activations/recompute.py):
        # module hooks then ignore it. ``units`` records the candidates while profiling.
        self.recomputing = 0
        self.units: UnitRecorder | None = None
        self.recomputed: tuple[str, ...] = ()
        self.selective: tuple[str, ...] = ()  # of those, recomputed selectively
        self.policy = policy
        self.tracker = tracker
        self.device = device
        self.protected = protected_storages
        self.baseline_bytes = baseline_bytes
        self.min_tensor_bytes = min_tensor_bytes
        self.record_trace = record_trace
        self.executor = executor
        # NOTE [transient bytes]: ops allocate workspaces (convolution im2col buffers, say) that
        # live only inside one call, where no hook can sample them. While profiling, the
        # process's RSS high-water mark is read at every step boundary: what a step grew in RSS
        # beyond what it grew in tracked bytes is its transient, which the trace records and,
        # with ``count_workspaces``, the plan and the policy
        # then budget for. It also keeps the iteration's RSS peak (``rss_peak_bytes``). With
        # ``count_workspaces`` every iteration measures them, so the reactive policy (which
        # never profiles) learns them too.
        self.rss = rss if record_trace or count_workspaces else None
        self.count_workspaces = count_workspaces
        self.rss_peak_bytes = 0
        # Allowed overshoot: one chunk (a whole tensor at tensor granularity cannot be bounded).
        self.overshoot_bytes = store.chunk_bytes or MIN_BUDGET_MARGIN_BYTES
        # On CUDA the allocator counts every tensor; on CPU the heap counter is process-wide, so
        # count the growth since entry on top of the tensors known to exist at entry.
        self._absolute = device.type == "cuda"
        self._entry_counter = tracker.current_bytes()
        self._entry_released = store.released_bytes
        self._entry_pool = tracker.pool_bytes()
        self.one_time_bytes = 0  # NOTE [MKL buffer pool]: measured when the iteration ends
        self.books = IterationBooks()
        self.floor = BudgetFloor(store, self.books, policy.budget_bytes)
        self.step_index = -1
        self._open: OpenStep | None = None
        self._last_param = 0
        self._last_live = 0
        self._note_live(self.live_bytes())
        self._backward_done_queued = False
        # NOTE [lean replay]: a replayed plan that this process measured in full while
        # profiling is followed with per-tensor work only where the plan acts: hook points
        # inside a module (saves, unpacks, backward nodes) route to the store and the plan, and
        # the tracked bytes are read, and the guard acts, at the module boundaries the plan
        # watches only: its predicted peak's and those it predicts near the budget. The
        # profiled iteration judged every hook point and backward node; the replay repeats
        # it (the executor checks every saved tensor's size and every step's name, and a
        # divergence turns the checks back on for the rest of the iteration). A boundary reading
        # over the budget also turns them back on, and the plan is profiled again next time:
        # a lean iteration cannot state a minimum budget of its own (it has not judged every
        # point), so it reports the profiled iteration's. A plan replays lean only once a full
        # replay of it needed nothing from the guard (no eviction beyond the plan's): where the
        # guard helps, it helps between boundaries too (``PlanBook``).
        # Only a plan that leaves the guard its headroom (NOTE [plan within the guard]): where
        # the plan fills the whole budget, the guard acts between boundaries as well.
        self.lean = (
            lean
            and executor is not None
            and executor.plan.budget_bytes + executor.plan.reserve_bytes <= policy.budget_bytes
            and params is None
            and not count_workspaces
            and not record_trace
        )
        self.was_lean = self.lean
        if self.lean:
            policy.follow_plan(True)
        self._lean_step = ""
        self.begin_step("other:start")

    # -- measurement --------------------------------------------------------------------------
    def _note_live(self, live: int) -> None:
        self._last_live = live
        self._last_param = self.params.resident_bytes() if self.params is not None else 0

    def _growth(self, live: int) -> int:
        """Growth since the last hook point that nobody announced: the guard's headroom.

        Reads of the parameter offloading sharing the budget are announced (``make_room``) and,
        under a joint plan, planned; they are not headroom the guard must keep.
        """
        param = self.params.resident_bytes() if self.params is not None else 0
        return live - self._last_live - max(0, param - self._last_param)

    def _step_name(self) -> str:
        if self._open is not None:
            return self._open.name
        return self._lean_step or "start"

    def live_bytes(self) -> int:
        """Tracked device bytes now."""
        now = self.tracker.current_bytes()
        if self._absolute:
            return now
        # Pages released in place are still allocated for the heap counter (NOTE [release in
        # place] in io/pages.py). Frees of memory allocated before the step (a previous loss,
        # say) lower the counter below its entry value; never report less than nothing.
        released = self.store.released_bytes - self._entry_released
        return max(0, self.baseline_bytes + now - self._entry_counter - released)

    def _sample(self, live: int) -> None:
        if live > self.policy.budget_bytes + self.overshoot_bytes:
            # The budget broke before the policy could act (an op allocated more than the
            # headroom): the iteration is infeasible at this budget as run.
            self.books.violated = True
            self.floor.note_broken(live, self._step_name())
        self.books.peak_bytes = max(self.books.peak_bytes, live)
        if self._open is not None:
            self._open.peak = max(self._open.peak, live)
            if self.record_trace:
                unmanaged = live - self.store.device_bytes()
                if self.params is not None:
                    unmanaged -= self.params.resident_bytes()  # the plan places them
                self._open.unmanaged_peak = max(self._open.unmanaged_peak, unmanaged)

    # -- hook target --------------------------------------------------------------------------
    def accepts(self, tensor: torch.Tensor) -> bool:
        """Plain dense tensors on the managed device, not parameters or buffers, not tiny."""
        if not self._plain(tensor):
            return False
        if not self._big_enough(tensor.untyped_storage()):
            self.books.unmanaged_saved_bytes += tensor.nbytes
            return False
        return True

    def manages(self, tensor: torch.Tensor) -> bool:
        """Whether ``accepts`` would make a vTensor of ``tensor`` (without its accounting)."""
        return self._plain(tensor) and self._big_enough(tensor.untyped_storage())

    def _big_enough(self, storage: torch.UntypedStorage) -> bool:
        return storage.nbytes() >= self.min_tensor_bytes and storage.resizable()

    def _plain(self, tensor: torch.Tensor) -> bool:
        if type(tensor) not in _PLAIN_TENSOR_TYPES or tensor.layout != torch.strided:
            return False
        if tensor.device.type != self.device.type or tensor.is_quantized or tensor.is_nested:
            return False
        return tensor.untyped_storage()._cdata not in self.protected

    def on_pack(self, record: VTensor, tensor: torch.Tensor) -> None:
        """Account a newly saved tensor and keep the budget."""
        if record.vid not in self.books.tensors:
            self.books.tensors[record.vid] = record
            if self.executor is not None:
                self.executor.on_record(record)
        if self.lean:
            if self.executor is not None and self.executor.active:
                return  # NOTE [lean replay]
            self._leave_lean()
        self.books.dtypes.setdefault(record.vid, set()).add(str(tensor.dtype).replace("torch.", ""))
        self.enforce()

    def before_unpack(self, record: VTensor) -> None:
        """Make room for the bytes of ``record`` that must come back."""
        if self.lean:
            self.store.reap(block=False, block_restores=False)
            return  # the plan has made room (NOTE [lean replay])
        incoming = sum(c.nbytes for c in record.offloaded_chunks())
        resident = record.storage.nbytes() if record.storage is not None else 0
        if incoming and resident and not record.in_place:
            # NOTE [growing a partial vTensor]: on the copy path growing a storage reallocates
            # it, so the resident prefix and the full size coexist while the prefix is copied.
            # Make room for the whole size; if that is impossible, send the prefix out as well,
            # which trades a write and a read of the prefix for the transient. Released in
            # place, only the incoming bytes are allocated.
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
        live = self.live_bytes()
        self._sample(live)
        if (self.executor is None or not self.executor.active) and self.policy.prefetch(
            live, record
        ):
            live = self.live_bytes()
            self._sample(live)
        self._note_live(live)

    def begin_step(self, name: str) -> None:
        """Close the open step and open the next one."""
        if self._step_name() == name and (self._open is not None or self.lean):
            return
        if name.startswith("backward:") and not self._backward_done_queued:
            # Mark the end of backward (optimizer work that follows is its own step).
            self._backward_done_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        if self.lean:
            self._lean_step = name
            self.step_index += 1
            assert self.executor is not None
            # The plan counts an eviction's bytes as gone from its step on: each has had the
            # previous step to overlap with, and is waited for now. No guard reads the bytes
            # between boundaries, so this is what keeps compute from running ahead of the
            # writes (a full replay's guard waits once the headroom is gone instead).
            self.store.reap(block=True, block_restores=False)
            self.executor.on_step(self.step_index, name)
            if self.executor.active:
                if self.step_index in self.executor.watched:
                    self._check_boundary()
                return
            self._leave_lean()
            self.step_index -= 1  # opened again below, with the books
        self._close_step()
        self.step_index += 1
        epoch = self.store.memory_epoch
        live = self.live_bytes()
        self._open = OpenStep(
            self.step_index, name, time.perf_counter(), live, live, _copy(self.store.stats)
        )
        if self.rss is not None:
            self.rss.reset_peak()
            self._open.rss_start = self.rss.current_rss_bytes()
        if self.executor is not None:
            self.executor.on_step(self.step_index, name)
            self.policy.follow_plan(self.executor.active)
        if self.params is not None:
            # The plan's reads at this step: make room for each under the budget, then start it.
            for entry in self.params.on_step(self.step_index):
                self.make_room(entry.nbytes)
                self.params.read(entry)
        # NOTE [reused readings]: a heap-counter read walks every free chunk of every malloc
        # arena (12-41 us measured); while no storage was resized or freed since the reading
        # above (``store.memory_epoch``), it still holds. Reads of a parameter offloading are
        # not counted by the epoch, so a joint iteration always reads again.
        same = self.store.memory_epoch == epoch and self.params is None
        self.enforce(live_hint=live if same else None)

    def _check_boundary(self) -> None:
        """A lean replay's reading at a module boundary (NOTE [lean replay])."""
        live = self.live_bytes()
        self._sample(live)
        # The growth since the last reading spans many steps here: no headroom the guard must
        # keep between two hook points (the plan's reserve stands).
        self._note_live(live)
        if self.books.violated:
            logger.warning(
                "a replayed plan went over the budget at step %r (%d bytes of %d): checking "
                "every hook point from here on, and profiling again next iteration",
                self._lean_step,
                live,
                self.policy.budget_bytes,
            )
            self._leave_lean()
            self.enforce(live_hint=live)
        elif live > self.policy.high_watermark():
            self.enforce(live_hint=live)

    def _leave_lean(self) -> None:
        self.lean = False
        self.policy.follow_plan(self.executor is not None and self.executor.active)

    def after_node(self) -> None:
        """Sample a backward node's working set (NOTE [node peaks] in ``activations/hooks.py``).

        No eviction here: the node's bytes are already allocated. What grew since the last
        hook point is headroom the policy must keep (``reserve``), and a working set above the
        budget breaks it like any other sample; its floor is judged against what was evictable
        at the previous hook point, which is what could have made room.
        """
        live = self.live_bytes()
        self._sample(live)
        self.policy.keep_reserve(self._growth(live))
        # The budget breaks here as at any sample (more than one chunk over, ``_sample``): the
        # policy had no chance to act since the last hook point.
        self.floor.note(live, None, self._step_name(), self.step_index, strict=False)
        self._note_live(live)

    def _backward_done(self) -> None:
        self._backward_done_queued = False
        self.begin_step("other:after-backward")

    # -- the budget ---------------------------------------------------------------------------
    def make_room(self, nbytes: int) -> None:
        """Evict activations so that ``nbytes`` about to be allocated elsewhere fit the budget.

        The parameter offloading that shares the budget calls this before each read.
        """
        self.enforce(incoming_bytes=nbytes, judge=False)

    def enforce(
        self,
        incoming_bytes: int = 0,
        pinned: VTensor | None = None,
        *,
        judge: bool = True,
        live_hint: int | None = None,
    ) -> None:
        """Keep tracked device bytes (plus ``incoming_bytes`` about to arrive) under the budget.

        ``pinned`` is the vTensor about to be used: it is neither evicted nor counted as
        evictable. ``judge=False`` makes room without recording feasibility (a first attempt).
        ``live_hint`` is a reading of the tracked bytes taken since the store last moved
        memory; it is used instead of a new reading while nothing moves (NOTE [reused readings]).
        """
        # NOTE [deterministic reaping]: while profiling or reacting, every eviction started
        # before this point completes here (it has had at least one op of compute to overlap
        # with), so the memory it frees, and the decisions that follow (the trace, the plan),
        # depend on the sequence of hook events rather than on disk speed. While a plan is
        # replayed, the decisions are the plan's: evictions still in flight are left to run
        # (their bytes count as live until they complete) and are waited for only when the
        # headroom below needs them, so the writes overlap the following ops instead of
        # stalling at the next hook. Restores are never waited for here: their bytes are
        # allocated when they start, and backward waits on them only when it uses them.
        replaying = self.executor is not None and self.executor.active
        epoch = self.store.memory_epoch
        self.store.reap(block=not replaying, block_restores=False)
        if live_hint is None or self.store.memory_epoch != epoch:
            live = self.live_bytes()
        else:
            live = live_hint  # NOTE [reused readings]
        self._sample(live)
        self.policy.keep_reserve(self._growth(live))
        epoch = self.store.memory_epoch
        self.policy.enforce(live + incoming_bytes, pinned)
        if self.store.memory_epoch != epoch or self.params is not None:
            live = self.live_bytes()  # else nothing was freed or grown since the read above
        if live + incoming_bytes > self.policy.high_watermark():
            # Still no headroom for the next op: evict down to the watermark and wait for it.
            self.store.reap(block=True)
            self.policy.evict_down_to(
                self.live_bytes() + incoming_bytes, self.policy.high_watermark(), pinned
            )
            self.store.reap(block=True)
            live = self.live_bytes()
        if judge:
            self.floor.note(live + incoming_bytes, pinned, self._step_name(), self.step_index)
        self._note_live(live)

    # -- closing ------------------------------------------------------------------------------
    def _close_step(self) -> None:
        step = self._open
        if step is None:
            return
        transient = 0
        if self.rss is not None:
            # How far the step's peak rose above its end level, in RSS beyond what the samples
            # saw: allocations still held at the end (one-time kernel caches, outputs) are not
            # transient and are excluded.
            # Both rises are measured from the higher of the step's start and end levels, so
            # memory freed during the step (garbage of earlier code) is not mistaken for one.
            high_water = self.rss.peak_rss_bytes()
            self.rss_peak_bytes = max(self.rss_peak_bytes, high_water)
            rss_rise = high_water - max(step.rss_start, self.rss.current_rss_bytes())
            sampled_rise = step.peak - max(step.live_start, self.live_bytes())
            transient = max(0, rss_rise - max(sampled_rise, 0))
            if self.count_workspaces:
                self.policy.keep_transient(transient)
        self.books.close(step, self.store.stats, transient, counted=self.count_workspaces)
        self._open = None

    def finish(self) -> None:
        """Close the last step; measure the process memory the iteration kept for good."""
        self._close_step()
        self.one_time_bytes = max(0, self.tracker.pool_bytes() - self._entry_pool)

    def exclude_time(self, seconds: float) -> None:
        """Leave ``seconds`` (a check the profiler ran) out of the open step's duration."""
        if self._open is not None:
            self._open.started += seconds

    def trace(self, budget_bytes: int, chunk_bytes: int | None) -> Trace:
        """The iteration as a ``Trace``."""
        n_activations, n_steps = len(self.books.tensors), len(self.books.trace_steps)
        extra = [] if self.params is None else self.params.trace_tensors(n_activations, n_steps)
        trace = self.books.trace(
            extra, self.baseline_bytes, budget_bytes, chunk_bytes, self.device.type
        )
        units: tuple[TraceUnit, ...] = ()
        if self.units is not None:
            position = {vid: i for i, vid in enumerate(sorted(self.books.tensors))}
            names = [s.name for s in trace.steps]
            units = self.units.units(position, trace.tensors, names)
        return dataclasses.replace(
            trace, units=units, recomputed=self.recomputed, selective=self.selective
        )


def _copy(stats: StoreStats) -> StoreStats:
    return StoreStats(stats.bytes_out, stats.bytes_in, stats.transfer_s, stats.stall_s)
