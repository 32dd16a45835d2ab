"""The books of one managed iteration: per-step statistics and trace steps, then its Trace."""

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from vtensor.activations.recompute.profile.highs import UnitHighs
from vtensor.activations.report import StepStats
from vtensor.activations.store.chunk_store import StoreStats, VTensor
from vtensor.planner.trace import Phase, Trace, TraceStep, TraceTensor


@dataclass
class OpenStep:
    """The step running now: where it began and what it has seen so far."""

    index: int
    name: str
    started: float
    live_start: int
    peak: int
    stats_at_start: StoreStats
    unmanaged_peak: int = 0
    rss_start: int = 0
    # NOTE [backward parts] in planner/memory_model.py: each part's unmanaged peak so far.
    parts: list[int] = field(default_factory=lambda: [0])
    bases: list[int] = field(default_factory=lambda: [-1])  # each part's first sample
    node_ended: bool = False

    def note_unmanaged(self, nbytes: int) -> None:
        """A sample of ``nbytes`` not in vTensors: the step's and its part's peak."""
        self.unmanaged_peak = max(self.unmanaged_peak, nbytes)
        self.parts[-1] = max(self.parts[-1], nbytes)
        if self.bases[-1] < 0:
            self.bases[-1] = nbytes

    def begin_part(self) -> None:
        """A saved tensor is unpacked: a new part begins if a backward node ended since."""
        if self.node_ended:
            self.parts.append(0)
            self.bases.append(-1)
            self.node_ended = False

    def transient_bytes(self, rss_high_water: int, rss_now: int, live_now: int) -> int:
        """How far the step's peak rose above its end level, in RSS beyond what samples saw.

        NOTE [transient bytes]: op workspaces live inside one call, where no hook samples them:
        what a step grew in RSS high-water beyond its tracked rise is its transient. Both rises
        are measured from the higher of its start and end levels, so memory freed or still held
        is not mistaken for one.
        """
        rss_rise = rss_high_water - max(self.rss_start, rss_now)
        sampled_rise = self.peak - max(self.live_start, live_now)
        return max(0, rss_rise - max(sampled_rise, 0))


@dataclass
class IterationBooks:
    """What an iteration measured, for its report and trace."""

    steps: list[StepStats] = field(default_factory=list)
    trace_steps: list[TraceStep] = field(default_factory=list)
    tensors: dict[int, VTensor] = field(default_factory=dict)
    dtypes: dict[int, set[str]] = field(default_factory=dict)
    evictable_step: dict[int, int] = field(default_factory=dict)
    unmanaged_saved_bytes: int = 0
    peak_bytes: int = 0
    min_budget_bytes: int = 0
    min_budget_step: str = ""
    min_budget_kept_bytes: int = 0  # saved bytes that could not leave where the floor is
    min_budget_param_bytes: int = 0  # an offloaded parameter side's bytes in memory there
    violated: bool = False
    # per (step, hook event) the guard acted at: the largest rise after it (NOTE [step reserve])
    growth: dict[tuple[int, int], int] = field(default_factory=dict)
    # per vTensor, the step and part it was last unpacked in (NOTE [backward parts])
    last_part: dict[int, tuple[int, int]] = field(default_factory=dict)
    highs: UnitHighs = field(default_factory=UnitHighs)

    def book(self, record: VTensor) -> None:
        """A vTensor saved for the first time this iteration."""
        self.tensors[record.vid] = record
        self.highs.saved += record.nbytes

    def note_unmanaged(self, step: OpenStep, nbytes: int) -> None:
        """An unmanaged reading of ``nbytes`` in ``step``: its peaks, and the open units'."""
        step.note_unmanaged(nbytes)
        self.highs.note(nbytes)

    def unpacked(self, vid: int, step_index: int, step: OpenStep | None) -> None:
        """The vTensor ``vid`` was unpacked at step ``step_index``, running as ``step``."""
        self.last_part[vid] = (step_index, len(step.parts) - 1 if step is not None else -1)

    def note_growth(self, at: tuple[int, int], nbytes: int) -> None:
        """The bytes rose ``nbytes`` above where the guard acted, at (step, hook event) ``at``."""
        if nbytes > self.growth.get(at, 0):
            self.growth[at] = nbytes

    def step_growths(self) -> dict[int, tuple[int, ...]]:
        """Per step, its rises by hook event, trailing events without a rise left out."""
        by_step: dict[int, dict[int, int]] = {}
        for (step, event), nbytes in self.growth.items():
            by_step.setdefault(step, {})[event] = nbytes
        return {
            step: tuple(events.get(e, 0) for e in range(max(events) + 1))
            for step, events in by_step.items()
        }

    def close(self, step: OpenStep, stats: StoreStats, transient: int, *, counted: bool) -> None:
        """Book ``step`` as it ends; ``counted``: its ``transient`` joins the unmanaged peak."""
        now = time.perf_counter()
        # Time left out (NOTE [own time]) may cross a boundary a little: never below zero.
        duration = max(0.0, now - step.started)
        before = step.stats_at_start
        parted, extra = len(step.parts) > 1, transient if counted else 0
        phase = Phase(step.name.split(":", 1)[0])
        self.steps.append(
            StepStats(
                step.index,
                step.name,
                phase,
                duration,
                step.peak,
                stats.bytes_out - before.bytes_out,
                stats.bytes_in - before.bytes_in,
                stats.transfer_s - before.transfer_s,
                stats.stall_s - before.stall_s,
            )
        )
        self.trace_steps.append(
            TraceStep(
                step.index,
                step.name,
                phase,
                duration,
                step.live_start,
                step.peak,
                max(step.unmanaged_peak, 0) + extra,
                transient,
                part_peak_bytes=tuple(max(p, 0) + extra for p in step.parts) if parted else (),
                part_base_bytes=tuple(max(b, 0) for b in step.bases) if parted else (),
            )
        )

    def _last_part(self, record: VTensor, parted: set[int]) -> int:
        """The part of its last use step ``record`` was last unpacked in; -1: one part, unknown."""
        step, part = self.last_part.get(record.vid, (-1, -1))
        return part if record.uses and step == max(record.uses) and step in parted else -1

    def trace(
        self,
        extra: Sequence[TraceTensor],
        baseline_bytes: int,
        budget_bytes: int,
        chunk_bytes: int | None,
        device: str,
    ) -> Trace:
        """The iteration as a ``Trace``; ``extra`` are the parameter side's tensors."""
        ordered = sorted(self.tensors.values(), key=lambda r: r.vid)
        parted = {s.index for s in self.trace_steps if s.part_peak_bytes}
        tensors = tuple(
            TraceTensor(
                vid=position,  # position in order of first save: stable across iterations
                nbytes=r.nbytes,
                dtypes=tuple(sorted(self.dtypes[r.vid])),
                saved_step=r.saved_step,
                # First step at whose start it could go: it became evictable during this one.
                evictable_step=self.evictable_step.get(r.vid, -2) + 1,
                use_steps=tuple(r.uses),
                last_part=self._last_part(r, parted),
            )
            for position, r in enumerate(ordered)
        )
        tensors += tuple(extra)
        growths = self.step_growths()
        steps = tuple(replace(s, growth_bytes=growths.get(s.index, ())) for s in self.trace_steps)
        return Trace(
            steps=steps,
            tensors=tensors,
            unmanaged_saved_bytes=self.unmanaged_saved_bytes,
            baseline_bytes=baseline_bytes,
            budget_bytes=budget_bytes,
            chunk_bytes=chunk_bytes,
            device=device,
        )
