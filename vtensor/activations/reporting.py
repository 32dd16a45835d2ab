"""What a finished iteration gives: its report and its trace."""

import dataclasses
import time
from dataclasses import dataclass

import torch

from vtensor.activations.plan.iteration_plan import IterationPlan
from vtensor.activations.recompute.profile.cost import mechanism_costs
from vtensor.activations.report import Granularity, IterationReport, PlanSource, Policy
from vtensor.activations.runtime.iteration import Iteration
from vtensor.activations.store.chunk_store import ChunkStore
from vtensor.measure.independent import IndependentPeak
from vtensor.planner.costs import Transfers
from vtensor.planner.trace import Trace, TraceUnit


@dataclass(frozen=True)
class StoreCounters:
    """The store's transfer counters at one moment, to report an iteration's share of them."""

    bytes_out: int
    bytes_in: int
    transfer_s: float
    stall_s: float
    copied_bytes: int
    write_s: float

    @classmethod
    def of(cls, store: ChunkStore) -> "StoreCounters":
        """The counters of ``store`` now."""
        s = store.stats
        return cls(s.bytes_out, s.bytes_in, s.transfer_s, s.stall_s, s.copied_bytes, s.write_s)

    def since(self, before: "StoreCounters") -> Transfers:
        """The transfers between ``before`` and these counters."""
        write_s = self.write_s - before.write_s
        read_s = self.transfer_s - before.transfer_s - write_s
        return Transfers(
            self.bytes_out - before.bytes_out, write_s, self.bytes_in - before.bytes_in, read_s
        )


def iteration_report(
    index: int,
    iteration: Iteration,
    chosen: IterationPlan,
    source: PlanSource,
    granularity: Granularity,
    device: torch.device,
    peaks: IndependentPeak,
    before: StoreCounters,
    started: float,
    pending_state_bytes: int,
    planning_s: float = 0.0,
) -> IterationReport:
    """The report of ``iteration``, the ``index``-th of its manager."""
    now = StoreCounters.of(iteration.store)
    books = iteration.books
    executor = chosen.executor
    plan = executor.plan if executor is not None else None
    return IterationReport(
        iteration=index,
        policy=Policy.PLANNED if executor is not None and executor.active else Policy.REACTIVE,
        granularity=granularity,
        plan_source=source,
        device=device.type,
        budget_bytes=iteration.policy.budget_bytes,
        chunk_bytes=iteration.store.chunk_bytes,
        peak_device_bytes=books.peak_bytes,
        peak_independent_bytes=peaks.peak(iteration.baseline_bytes, iteration.rss_peak_bytes),
        independent_kind=peaks.kind,
        # NOTE [lean replay]: a lean iteration states the minimum of the one it replays.
        min_budget_bytes=(
            plan.min_budget_bytes
            if iteration.lean and plan is not None
            else books.min_budget_bytes + pending_state_bytes
        ),
        bytes_out=now.bytes_out - before.bytes_out,
        bytes_in=now.bytes_in - before.bytes_in,
        transfer_s=now.transfer_s - before.transfer_s,
        stall_s=now.stall_s - before.stall_s,
        copied_bytes=now.copied_bytes - before.copied_bytes,
        wall_s=time.perf_counter() - started,
        steps=tuple(books.steps),
        predicted_peak_bytes=plan.predicted_peak_bytes if plan is not None else None,
        predicted_stall_s=plan.predicted_stall_s if plan is not None else None,
        planning_s=planning_s,
        cache_load_s=chosen.cache_load_s,
        one_time_bytes=iteration.one_time_bytes,
        recomputed=iteration.recomputed,
        lean=iteration.lean,
    )


def iteration_trace(iteration: Iteration, budget_bytes: int, chunk_bytes: int | None) -> Trace:
    """``iteration`` as a ``Trace``: its books, the parameters' tensors, its units."""
    books = iteration.books
    params = iteration.params
    extra = (
        [] if params is None else params.trace_tensors(len(books.tensors), len(books.trace_steps))
    )
    trace = books.trace(
        extra, iteration.baseline_bytes, budget_bytes, chunk_bytes, iteration.device.type
    )
    units: tuple[TraceUnit, ...] = ()
    if iteration.units is not None and iteration.units.seen:
        position = {vid: i for i, vid in enumerate(sorted(books.tensors))}
        names = [s.name for s in trace.steps]
        costs = mechanism_costs(str(iteration.device))
        units = iteration.units.units(position, trace.tensors, names, costs)
    return dataclasses.replace(
        trace,
        recomputed=iteration.recomputed,
        units=units,
        encoded=iteration.encoded,
    )
