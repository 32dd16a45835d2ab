"""Typed statistics of a managed iteration, per step and in total."""

from dataclasses import dataclass
from enum import StrEnum

from vtensor.measure.independent import PeakSource
from vtensor.planner.trace import Phase
from vtensor.sizes import format_bytes


class Policy(StrEnum):
    """Which policy decides what leaves memory and when."""

    PLANNED = "planned"  # profile one iteration, plan it with the LGM, replay the plan
    REACTIVE = "reactive"  # no planning: evict the farthest use, prefetch the nearest


class Granularity(StrEnum):
    """Unit of swapping."""

    CHUNK = "chunk"  # fixed-size chunks: move exactly what the budget demands
    TENSOR = "tensor"  # whole saved tensors: the prior-work baseline


class PlanSource(StrEnum):
    """Where the swap decisions of an iteration came from."""

    PROFILED = "profiled"  # no plan yet: reactive policy, and the iteration is recorded
    PLANNED = "planned"  # a plan made in this process from an earlier iteration
    CACHED = "cached"  # a plan loaded from the plan cache: no profiling in this process
    FALLBACK = "fallback"  # the run diverged from its plan: reactive for the rest
    REACTIVE = "reactive"  # reactive only (policy="reactive", or the planner found no plan)


@dataclass(frozen=True)
class StepStats:
    """What happened during one step.

    Attributes:
        name: ``forward:<module>``, ``backward:<module>`` or ``other:<what>``.
        peak_device_bytes: largest tracked device bytes sampled during the step.
        bytes_out, bytes_in: bytes whose eviction or restore completed during the step.
        transfer_s, stall_s: time those transfers spent copying, and compute waited on them.
    """

    index: int
    name: str
    phase: Phase
    duration_s: float
    peak_device_bytes: int
    bytes_out: int
    bytes_in: int
    transfer_s: float
    stall_s: float


@dataclass(frozen=True)
class IterationReport:
    """Statistics of one iteration run under ``MemoryManager.step``.

    Attributes:
        iteration: 0 for the first managed iteration.
        policy: "planned" (a plan was replayed to the end) or "reactive".
        plan_source: where the swap decisions came from (:class:`PlanSource`).
        peak_device_bytes: tracked peak: the state at entry plus the allocator count's growth,
            sampled at every hook point.
        peak_independent_bytes: baseline plus the growth of peak RSS (CPU) or
            ``torch.cuda.max_memory_allocated``; None unless ``measure_peaks``.
        min_budget_bytes: the smallest budget that would have worked for this iteration.
        bytes_out, bytes_in: bytes moved to the slower tier and back.
        stall_s: time compute waited on transfers.
        predicted_peak_bytes, predicted_stall_s: the plan's (None without a plan).
        planning_s, cache_load_s: time spent planning after it, loading the plan before it.
        copied_bytes: resident prefixes copied by ``resize_`` on the copy path (CUDA, shared
            memory).
        one_time_bytes: non-tensor memory kept for good (NOTE [MKL buffer pool]), outside the
            budget.
        recomputed: the modules whose forward ran again in backward (NOTE [recompute]).
        params_offloaded: the manager offloaded the model's parameters, gradients and optimizer
            state in this iteration; ``params_bytes_out`` and ``params_bytes_in`` are what they
            moved (the other byte figures count activations only).
        lean: checked at watched boundaries only (NOTE [lean replay]): ``steps`` is empty and
            ``min_budget_bytes`` the profiled iteration's.
    """

    iteration: int
    policy: Policy
    granularity: Granularity
    plan_source: PlanSource
    device: str
    budget_bytes: int
    chunk_bytes: int | None
    peak_device_bytes: int
    peak_independent_bytes: int | None
    independent_kind: PeakSource | None
    min_budget_bytes: int
    bytes_out: int
    bytes_in: int
    transfer_s: float
    stall_s: float
    wall_s: float
    steps: tuple[StepStats, ...]
    predicted_peak_bytes: int | None = None
    predicted_stall_s: float | None = None
    planning_s: float = 0.0
    cache_load_s: float = 0.0
    one_time_bytes: int = 0
    copied_bytes: int = 0
    recomputed: tuple[str, ...] = ()
    lean: bool = False
    budget_source: str = ""
    params_offloaded: bool = False
    params_bytes_out: int = 0
    params_bytes_in: int = 0

    @property
    def bytes_moved(self) -> int:
        """Bytes moved in both directions."""
        return self.bytes_out + self.bytes_in

    def __str__(self) -> str:
        """One line a person reads; the fields hold the rest (``steps``: per step)."""
        how = f"{self.plan_source.value} plan, lean" if self.lean else self.plan_source.value
        recomputed = f"; recomputed {len(self.recomputed)} modules" if self.recomputed else ""
        params = ""
        if self.params_offloaded:
            out, back = format_bytes(self.params_bytes_out), format_bytes(self.params_bytes_in)
            params = f"; parameters, gradients and optimizer state offloaded: {out} out, {back} in"
        return (
            f"iteration {self.iteration} ({how}): peak {format_bytes(self.peak_device_bytes)} "
            f"of a {format_bytes(self.budget_bytes)} budget; moved "
            f"{format_bytes(self.bytes_out)} out, {format_bytes(self.bytes_in)} in, stall "
            f"{self.stall_s:.3f} s{recomputed}{params}; {self.wall_s:.3f} s"
        )
