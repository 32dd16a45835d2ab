"""The public memory manager: one context manager per training iteration under a budget."""

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from enum import Enum
from os import PathLike
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from vtensor.activations.model_state import ScanCache, device_of, state_storages
from vtensor.activations.offloads import Offloads
from vtensor.activations.plan.decision import PlanBook
from vtensor.activations.plan.iteration_plan import IterationPlan
from vtensor.activations.report import Granularity, IterationReport, Policy
from vtensor.activations.reporting import StoreCounters, iteration_report, iteration_trace
from vtensor.activations.runtime.budgeting import ManagerBudget
from vtensor.activations.runtime.iteration import Iteration
from vtensor.activations.runtime.policy import ReactivePolicy
from vtensor.activations.store.chunk_store import ChunkStore
from vtensor.activations.wiring import instrumented
from vtensor.errors import VTensorError
from vtensor.io.chunk import DEFAULT_CHUNK_BYTES
from vtensor.io.engines import Tier, engine_for, resolve_tier
from vtensor.measure.clock import device_now
from vtensor.measure.counter import cpu_counter, make_device_tracker
from vtensor.measure.independent import IndependentPeak
from vtensor.measure.optimizer_state import StateShape, pending_state_bytes
from vtensor.measure.trackers import DeviceTracker, quiet_heap
from vtensor.offload.joint import (
    JointStep,
    ParamOffloadReport,
    held_outside,
)
from vtensor.planner.plan import Plan
from vtensor.planner.trace import Trace
from vtensor.sizes import format_bytes, parse_bytes

if TYPE_CHECKING:
    from vtensor.offload.param_offload import ParamOffload

logger = logging.getLogger(__name__)

E = TypeVar("E", bound=Enum)


def _one_of(kind: type[E], value: object, name: str) -> E:
    """``value`` as a member of ``kind``, or an error naming the members."""
    try:
        return kind(value)
    except ValueError:
        raise VTensorError(f"{name}={value!r} is not one of {[k.value for k in kind]}") from None


def _runs_on_cpu(device: torch.device | None) -> bool:
    """Whether a manager for ``device`` (None: the model's) will measure CPU memory."""
    return device.type == "cpu" if device is not None else not torch.cuda.is_available()


class MemoryManager:
    """Trains any ``nn.Module`` under a hard memory budget: the whole training state, one budget.

    Saved activations are swapped in chunks, recomputed or kept; parameters, gradients and
    optimizer state are offloaded under the same budget where they must be (``offload_params``).
    The loop stays plain torch; weights come out bit-identical to the same loop unmanaged::

        with vtensor.MemoryManager("256MiB") as mm:
            for x, y in loader:
                with mm.step(model, optimizer, inputs=(x, y)):
                    loss_fn(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
            print(mm.report())

    Args:
        budget: device-tier bytes, as an int or a string such as ``"256MiB"`` or ``"1.5GB"``;
            ``"N%"`` of this model and batch's unmanaged peak, from the second iteration on; or
            ``"auto"``: what the device can give now (NOTE [budget forms] in
            ``vtensor/budget.py``). ``budget_bytes`` and ``budget_source`` say what it became.
        chunk_bytes: chunk size (default 1 MiB, see NOTE [default chunk size]).
        storage_dir: directory of the swap file (CPU); default: the system temporary directory.
        granularity: ``"chunk"`` or ``"tensor"`` (whole tensors, the prior-work baseline).
        device: the managed device; default: the device of the model's first parameter.
        min_tensor_bytes: saved tensors smaller than this stay resident.
        prefetch_depth: how many saved tensors backward prefetches ahead.
        drop_page_cache: drop swap-file pages from the page cache after each transfer, so
            swapped-out bytes really leave RAM.
        encrypt_storage: seal every chunk written to the swap file with AES-256-GCM under a
            key that exists only in this process (docs/encryption.md). The pinned host tier
            (CUDA) is not encrypted.
        host_capacity_bytes: bound of the pinned host tier (CUDA).
        tier: where evicted chunks go on CUDA: ``"host"`` (pinned memory), ``"storage"`` (the
            swap file) or ``"auto"``: storage where the GPU shares memory with the host (a
            Jetson), host otherwise. On CPU the swap file always.
        plan_cache_dir: directory of the plan cache, shared by processes (None: no cache).
        count_workspaces: also budget the memory ops allocate internally, measured from the
            process's peak RSS while profiling (CPU only; turns ``measure_peaks`` on). The
            budget then holds for the RSS, at the price of smaller usable budgets.
        measure_peaks: measure an independent peak per iteration
            (``report().peak_independent_bytes``). It resets process-wide high-water marks
            other tools read (VmHWM on CPU, ``torch.cuda``'s peak statistics).
        policy: ``"planned"`` (profile, plan, replay) or ``"reactive"`` (no planning).
        recompute: plans may also recompute modules in backward where the calibrated model
            predicts it faster (NOTE [one decision]). Training stays bit-identical. Planned
            policy only, not with parameter offloading.
        check_every_hook: judge the budget at every hook point of every replay. Off, a proven
            plan replays lean (NOTE [lean replay]); its report then has no per-step statistics
            and states the profiled iteration's minimum.
        encode_masks: ``nn.ReLU6`` and ``nn.Hardtanh`` save their output instead of their
            input, bit-identically (NOTE [mask encoding]); ``"auto"``: where the plan moves bytes.
        offload_params: manage the parameters, gradients and optimizer state given to
            :meth:`step` under the same budget, in one plan: ``"auto"`` where they would take
            more than half of it (NOTE [offload auto] in ``offload/joint.py``), ``True``,
            ``False``. Offloaded, each parameter is updated as its gradient completes, so the
            ``optimizer.step()`` after the block changes nothing; to read or clip gradients use
            :class:`ParamOffload` with ``max_grad_norm`` instead. CPU only.
    """

    def __init__(
        self,
        budget: int | float | str,
        *,
        chunk_bytes: int | str = DEFAULT_CHUNK_BYTES,
        storage_dir: str | PathLike[str] | None = None,
        granularity: str | Granularity = Granularity.CHUNK,
        device: str | torch.device | None = None,
        min_tensor_bytes: int = 4096,
        prefetch_depth: int = 2,
        drop_page_cache: bool = True,
        encrypt_storage: bool = True,
        host_capacity_bytes: int | None = None,
        tier: str | Tier = Tier.AUTO,
        plan_cache_dir: str | PathLike[str] | None = None,
        policy: str | Policy = Policy.PLANNED,
        count_workspaces: bool = False,
        measure_peaks: bool = False,
        recompute: bool = False,
        check_every_hook: bool = False,
        encode_masks: bool | str = False,
        offload_params: bool | str = "auto",
    ) -> None:
        if encode_masks not in (True, False, "auto"):
            raise VTensorError(f"encode_masks={encode_masks!r}: use True, False or 'auto'")
        self.chunk_bytes = parse_bytes(chunk_bytes, what="chunk_bytes")
        self.granularity = _one_of(Granularity, granularity, "granularity")
        self._offloads = Offloads(
            offload_params,
            chunk_bytes=self.chunk_bytes,
            storage_dir=storage_dir,
            encrypt_storage=encrypt_storage,
            drop_page_cache=drop_page_cache,
            min_tensor_bytes=min_tensor_bytes,
        )
        self.storage_dir = storage_dir
        self.device = torch.device(device) if device is not None else None
        if _runs_on_cpu(self.device):
            cpu_counter()  # refuse now a budget that could not be measured (NOTE [CPU counter])
        self.min_tensor_bytes = min_tensor_bytes
        self.prefetch_depth = prefetch_depth
        self.drop_page_cache = drop_page_cache
        self.encrypt_storage = encrypt_storage
        self.host_capacity_bytes = host_capacity_bytes
        self.tier = _one_of(Tier, tier, "tier")
        if self.device is not None:
            resolve_tier(self.device, self.tier)  # a tier the device cannot have fails now
        self.count_workspaces = count_workspaces
        self.measure_peaks = measure_peaks or count_workspaces
        self.policy = _one_of(Policy, policy, "policy")
        self._budget = ManagerBudget(budget, planned=self.policy is Policy.PLANNED)
        self.plan_cache_dir = plan_cache_dir
        self.recompute, self.encode_masks = recompute, encode_masks
        self._plans = self._plan_book()
        self.check_every_hook = check_every_hook
        self._store: ChunkStore | None = None
        self._policy: ReactivePolicy | None = None
        self._peaks: IndependentPeak | None = None
        self._reports: list[IterationReport] = []
        self._trace: Trace | None = None
        self._state_shapes: dict[tuple[int, torch.dtype], StateShape | None] = {}
        self._scans = ScanCache()  # NOTE [scan once]
        self._tracker: DeviceTracker  # made with the store, once: it holds no state of a step
        self._active = False

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> "MemoryManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for transfers, free every chunk, delete the swap file; parameters come back."""
        self._offloads.close()
        if self._store is not None:
            self._store.close()
            self._store.engine.close()
            self._store = None
        if self._peaks is not None:
            self._peaks.close()
            self._peaks = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: nothing more can be done
            self.close()

    @property
    def chunk_size(self) -> int | None:
        """Bytes per chunk, or None at tensor granularity."""
        return None if self.granularity is Granularity.TENSOR else self.chunk_bytes

    def _plan_book(self) -> PlanBook:
        return PlanBook(
            self.budget_bytes,
            self.chunk_size,
            self.plan_cache_dir,
            planned=self.policy is Policy.PLANNED,
            count_workspaces=self.count_workspaces,
            recompute=self.recompute,
            encode_masks=self.encode_masks,
        )

    @property
    def params_offloaded(self) -> bool:
        """Whether a model's parameters, gradients and optimizer state are offloaded here."""
        return bool(self._offloads)

    def offload_reports(self) -> tuple[ParamOffloadReport, ...]:
        """What each parameter offloading this manager made held and moved, in total."""
        return self._offloads.reports()

    @property
    def budget_bytes(self) -> int:
        """The budget in bytes (0 until a budget of ``"N%"`` or ``"auto"`` resolves)."""
        return self._budget.nbytes

    @property
    def budget_source(self) -> str:
        """Where :attr:`budget_bytes` came from (NOTE [budget forms] in ``vtensor/budget.py``)."""
        return self._budget.source

    @property
    def unmanaged_peak_bytes(self) -> int | None:
        """The unmanaged peak of this model and batch, from the first profiled trace."""
        return self._budget.unmanaged_peak_bytes

    def _budget_resolved(self) -> None:
        """The budget changed: plans and the reactive policy follow it."""
        self._plans = self._plan_book()
        if self._store is not None:
            self._policy = ReactivePolicy(self._store, self.budget_bytes, self.prefetch_depth)
        logger.info("budget %s: %s", format_bytes(self.budget_bytes), self.budget_source)

    def _ensure_started(
        self, device: torch.device
    ) -> tuple[ChunkStore, ReactivePolicy, DeviceTracker]:
        if self._store is not None and self._policy is not None:
            return self._store, self._policy, self._tracker
        engine = engine_for(
            device,
            tier=self.tier,
            staging_bytes=self.chunk_bytes,
            host_capacity_bytes=self.host_capacity_bytes,
            storage_dir=self.storage_dir,
            drop_page_cache=self.drop_page_cache,
            encrypt=self.encrypt_storage,
        )
        self._store = ChunkStore(engine, self.chunk_size)
        self._policy = ReactivePolicy(self._store, self.budget_bytes, self.prefetch_depth)
        self._tracker = make_device_tracker(device)
        self._store.populate_restores = self._tracker.counts_released_pages
        return self._store, self._policy, self._tracker

    # -- one iteration ------------------------------------------------------------------------
    @contextmanager
    def step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        inputs: Sequence[torch.Tensor] = (),
        params: "ParamOffload | None" = None,
    ) -> Iterator[None]:
        """Manage one training iteration (forward and backward) of ``model`` under the budget.

        Args:
            model: the module being trained.
            optimizer: its state counts toward the budget; with ``offload_params``, the
                parameter side goes under the budget with it.
            inputs: tensors made before the step (the batch) that count toward the budget on CPU.
            params: a ``ParamOffload`` of ``model`` with the same budget (for clipping or
                accumulation), planned with the activations (NOTE [one plan] in
                ``vtensor/offload/joint.py``); call its ``step()`` after the block, and leave
                ``optimizer`` out.

        Raises:
            InfeasibleBudgetError: the budget cannot be met; states the whole iteration's
                minimum and what holds it (raised as the block exits, before any update).
        """
        if self._active:
            raise VTensorError("MemoryManager.step is already active; steps cannot nest")
        scan = self._scans.of(model)
        device = self.device or device_of(scan)
        # The state the user's optimizer creates at its first step.
        to_come = pending_state_bytes(optimizer, self._state_shapes) if optimizer else 0
        side = self._offloads.side_for(
            model,
            scan,
            optimizer,
            params,
            self.budget_bytes,
            device,
            self.granularity.value,
            to_come,
        )
        params, optimizer, pending = side.params, side.optimizer, side.pending
        store, policy, tracker = self._ensure_started(device)
        held = held_outside(params.pool, model) if params is not None else 0
        protected, held_state = state_storages(scan, optimizer, inputs, device)
        if not self.budget_bytes:
            self._budget.resolve_device(device, held_state)
            self._budget_resolved()
            store, policy, tracker = self._ensure_started(device)
        # Above the budget it still runs, so the minimum it states is the whole iteration's.
        baseline = held_state + held
        peaks = self._peaks = self._peaks or IndependentPeak(
            device, enabled=self.measure_peaks, rss=self.count_workspaces
        )
        with contextlib.ExitStack() as stack:
            if device.type == "cpu":
                stack.enter_context(quiet_heap())  # NOTE [quiet heap]
            peaks.start()
            signature = params.plan_signature() if params is not None else ""
            chosen = self._plans.for_iteration(model, scan, inputs, device, store, signature)
            executor = chosen.executor
            policy.use_plan(executor.plan if executor is not None else None)
            joint = None
            if params is not None:
                joint = JointStep(
                    params,
                    executor.plan if executor is not None else None,
                    lambda: executor is not None and executor.active,
                    record=chosen.record_trace,
                )
            iteration = Iteration(
                store,
                policy,
                tracker,
                device,
                protected,
                baseline,
                self.min_tensor_bytes,
                record_trace=chosen.record_trace,
                executor=executor,
                rss=peaks.rss,
                count_workspaces=self.count_workspaces,
                params=joint.side if joint is not None else None,
                lean=chosen.lean and not self.check_every_hook,
            )
            # Exits run in reverse: hooks off, pool disconnected, last step closed, store reaped.
            stack.callback(store.reap)
            stack.callback(iteration.finish)
            if joint is not None:
                stack.enter_context(joint.connected_to(iteration))
            stack.enter_context(instrumented(model, scan, iteration, chosen))
            started = device_now(device)
            stats_before = StoreCounters.of(store)
            params_before = params.report() if params is not None else None
            self._active = True
            stack.callback(setattr, self, "_active", False)
            yield
        books = iteration.books
        excused = books.violated and self._plans.excuse(chosen, iteration.was_lean)
        if side.probing or (books.violated and not excused):
            raise self._offloads.refusal(side, iteration, model, inputs, self.budget_bytes)
        self._record(iteration, chosen, device, started, stats_before, joint, pending, excused)
        if params is not None and params_before is not None:  # the parameter side's traffic
            after = params.report()
            self._reports[-1] = dataclasses.replace(
                self._reports[-1],
                params_offloaded=True,
                params_bytes_out=after.bytes_out - params_before.bytes_out,
                params_bytes_in=after.bytes_in - params_before.bytes_in,
            )
        peak = self._budget.unmanaged_peak_bytes or 0
        self._offloads.after_step(side, fits=0 < peak <= self.budget_bytes)

    def _record(
        self,
        iteration: Iteration,
        chosen: IterationPlan,
        device: torch.device,
        started: float,
        before: StoreCounters,
        joint: JointStep | None = None,
        pending_state_bytes: int = 0,
        excused: bool = False,
    ) -> None:
        assert self._store is not None and self._policy is not None and self._peaks is not None
        trace = None
        if chosen.record_trace:
            trace = iteration_trace(iteration, self.budget_bytes, self.chunk_size)
            if joint is not None and joint.created_state:
                trace = dataclasses.replace(trace, incomplete=True)
            self._trace = trace
        budget_source = self.budget_source
        source = self._plans.after_iteration(
            chosen,
            trace,
            reserve_bytes=self._policy.plan_reserve_bytes,
            min_budget_bytes=iteration.books.min_budget_bytes + pending_state_bytes,
            wall_s=device_now(device) - started,
            guard_bytes=self._guard_bytes(chosen, before),
            state_to_come_bytes=pending_state_bytes,
            moved=StoreCounters.of(self._store).since(before),
            excused=excused,
        )
        report = iteration_report(
            len(self._reports),
            iteration,
            chosen,
            source,
            self.granularity,
            device,
            self._peaks,
            before,
            started,
            pending_state_bytes,
            self._plans.planning_s if chosen.record_trace else 0.0,
        )
        self._reports.append(dataclasses.replace(report, budget_source=budget_source))
        kept = joint.side.consumed() if joint is not None and joint.side is not None else ()
        if trace is not None and self._budget.note_profile(trace, pending_state_bytes, kept):
            self._budget_resolved()
        if logger.isEnabledFor(logging.DEBUG):
            sizes = (report.peak_device_bytes, self.budget_bytes, report.bytes_out, report.bytes_in)
            sizes_text = ", ".join(map(format_bytes, sizes))
            logger.debug("iteration %d: peak, budget, out, in: %s", report.iteration, sizes_text)

    def _guard_bytes(self, chosen: IterationPlan, before: StoreCounters) -> int:
        """Bytes evicted in this iteration beyond what its plan's executor issued."""
        if chosen.executor is None or self._store is None:
            return 0
        return max(0, self._store.stats.bytes_out - before.bytes_out - chosen.executor.issued_bytes)

    # -- results ------------------------------------------------------------------------------
    def report(self) -> IterationReport:
        """Statistics of the last completed iteration."""
        if not self._reports:
            raise VTensorError("no iteration has completed under this MemoryManager yet")
        return self._reports[-1]

    @property
    def reports(self) -> tuple[IterationReport, ...]:
        """Statistics of every completed iteration, in order."""
        return tuple(self._reports)

    def plan_for(
        self,
        model: nn.Module,
        inputs: Sequence[torch.Tensor] = (),
        params: "ParamOffload | None" = None,
    ) -> Plan | None:
        """The plan replayed for ``model`` at ``inputs`` (``params`` as for :meth:`step`).

        Without ``params``, the joint plan with the offloading this manager made for ``model``,
        if it made one.
        """
        device = self.device or device_of(model)
        params = params or self._offloads.of_model(model)
        signature = params.plan_signature() if params is not None else ""
        return self._plans.plan_for(model, inputs, device, signature)

    @property
    def trace(self) -> Trace | None:
        """The trace of the last profiled iteration."""
        return self._trace
