"""The Layered Graph Model of a trace: its layers (steps), vTensor lives and what cannot move.

docs/lgm.md states the model; NOTE [memory model] in memory_model.py, what occupies memory.
"""

from dataclasses import dataclass
from enum import Enum
from typing import Literal

import numpy as np
import numpy.typing as npt

from vtensor.planner.memory_model import chunk_of, last_live_step, simulate, step_unmanaged
from vtensor.planner.plan import Plan
from vtensor.planner.trace import Trace, TraceTensor

# Conservative defaults for the swap file: writes that wait for write-back, cold reads.
DEFAULT_WRITE_BYTES_PER_S = 0.3e9
DEFAULT_READ_BYTES_PER_S = 1.2e9
PLANNER_VERSION = "lgm-belady/12"  # name/version; bump when plans change meaning

Bytes = npt.NDArray[np.int64]


class TraceDefault(Enum):
    """The sentinel of a default taken from the trace."""

    TRACE = "trace"


FROM_TRACE: Literal[TraceDefault.TRACE] = TraceDefault.TRACE
"""Default of ``chunk_bytes``: the trace's own chunk size."""


@dataclass(frozen=True)
class LayeredGraph:
    """The Layered Graph Model: one layer per trace step, each vTensor live over an interval.

    Layers are not objects: the planner walks the lives directly, linear in the trace.
    """

    trace: Trace
    chunk_bytes: int | None
    write_bytes_per_s: float
    read_bytes_per_s: float

    @property
    def n_steps(self) -> int:
        """Number of layers."""
        return len(self.trace.steps)

    def n_chunks(self, t: TraceTensor) -> int:
        """Chunks of a vTensor (1 for a whole one)."""
        chunk = chunk_of(t, self.chunk_bytes)
        return 1 if chunk is None else -(-t.nbytes // chunk)

    def full_resident(self) -> Bytes:
        """Resident bytes per layer with nothing swapped out."""
        return np.array(simulate(None, self.trace), dtype=np.int64)

    def floors(self) -> Bytes:
        """Bytes per layer that no plan can swap out (NOTE [memory model])."""
        n = self.n_steps
        delta = np.zeros(n + 1, dtype=np.int64)
        for t in self.trace.tensors:
            stop = last_live_step(t, n) + 1
            pinned_to = stop if t.evictable_step < 0 else min(t.evictable_step, stop)
            delta[t.saved_step] += t.nbytes
            delta[pinned_to] -= t.nbytes
            for u in sorted(set(t.use_steps)):
                if u >= pinned_to:
                    delta[u] += t.nbytes
                    delta[u + 1] -= t.nbytes
        return step_unmanaged(self.trace) + np.cumsum(delta[:n])


def evictable_at(t: TraceTensor, step: int) -> bool:
    """Whether ``t`` may have bytes away at ``step``."""
    return 0 <= t.evictable_step <= step and step not in t.use_steps


def build_lgm(
    trace: Trace,
    chunk_bytes: int | None,
    write_bytes_per_s: float = DEFAULT_WRITE_BYTES_PER_S,
    read_bytes_per_s: float = DEFAULT_READ_BYTES_PER_S,
) -> LayeredGraph:
    """Check ``trace`` and the parameters, and build its Layered Graph Model.

    Raises:
        ValueError: the trace is inconsistent or a parameter is not positive.
    """
    if chunk_bytes is not None and chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be positive or None (whole tensors)")
    if write_bytes_per_s <= 0 or read_bytes_per_s <= 0:
        raise ValueError("write_bytes_per_s and read_bytes_per_s must be positive")
    n = len(trace.steps)
    if any(s.index != i for i, s in enumerate(trace.steps)):
        raise ValueError("trace steps must be numbered 0, 1, ... in order; re-profile the model")
    for i, t in enumerate(trace.tensors):
        inside = all(t.saved_step <= u < n for u in t.use_steps)
        evictable = t.evictable_step == -1 or t.saved_step <= t.evictable_step < n
        if t.vid != i or t.nbytes <= 0 or not 0 <= t.saved_step < n or not inside or not evictable:
            raise ValueError(f"trace tensor {t} is inconsistent; re-profile the model")
    return LayeredGraph(trace, chunk_bytes, write_bytes_per_s, read_bytes_per_s)


def min_budget(lgm: LayeredGraph) -> tuple[int, int]:
    """The smallest feasible budget and the step that dominates it (first of the largest)."""
    floors = lgm.floors()
    if floors.size == 0:
        return 0, -1
    step = int(np.argmax(floors))
    return int(floors[step]), step


def empty_plan(trace: Trace, budget_bytes: int, chunk_bytes: int | None) -> Plan:
    """A plan of ``trace`` that moves nothing."""
    return Plan(
        budget_bytes=budget_bytes,
        chunk_bytes=chunk_bytes,
        moves=(),
        step_names=tuple(s.name for s in trace.steps),
        tensor_bytes=tuple(t.nbytes for t in trace.tensors),
        tensor_names=tuple(t.name for t in trace.tensors)
        if any(t.name for t in trace.tensors)
        else (),
        predicted_peak_bytes=0,
        predicted_stall_s=0.0,
        planner=PLANNER_VERSION,
    )
