"""The step-time model: constants measured on this machine, and the time it predicts (pure).

NOTE [calibrated model]
A step under a plan takes its measured compute (the profiled steps' durations, the manager's own
work left out: NOTE [own time]), plus its waits for transfers (``predict_stalls``),
plus the swap engine's CPU time per byte moved, plus its recomputations (``whole_s``). The
bandwidths come from the profiled iteration's transfers; the per-byte cost starts at 0 and is
corrected once from a validating replay. Keep, swap and recompute are priced by this one model;
no option is tried in an iteration of its own.
"""

from dataclasses import dataclass, replace

from vtensor.planner.lgm import DEFAULT_READ_BYTES_PER_S, DEFAULT_WRITE_BYTES_PER_S
from vtensor.planner.memory_model import predict_stalls, writing_moves
from vtensor.planner.plan import Plan
from vtensor.planner.recomputed import whole_s
from vtensor.planner.trace import Trace

# A validating replay within this share of its prediction confirms the model.
TIME_TOLERANCE = 0.15
# Fewer bytes than this moved while profiling measure no bandwidth: the defaults stand.
MIN_CALIBRATION_BYTES = 1 << 20


@dataclass(frozen=True)
class Transfers:
    """Bytes moved and seconds the swap engine spent on them, each way."""

    bytes_out: int = 0
    write_s: float = 0.0
    bytes_in: int = 0
    read_s: float = 0.0


@dataclass(frozen=True)
class Costs:
    """The constants of the step-time model (NOTE [calibrated model])."""

    write_bytes_per_s: float = DEFAULT_WRITE_BYTES_PER_S
    read_bytes_per_s: float = DEFAULT_READ_BYTES_PER_S
    swap_cpu_s_per_byte: float = 0.0

    def calibrated(self, moved: Transfers) -> "Costs":
        """These constants with the bandwidths ``moved`` measured, where it moved enough."""
        write, read = self.write_bytes_per_s, self.read_bytes_per_s
        if moved.bytes_out >= MIN_CALIBRATION_BYTES and moved.write_s > 0:
            write = moved.bytes_out / moved.write_s
        if moved.bytes_in >= MIN_CALIBRATION_BYTES and moved.read_s > 0:
            read = moved.bytes_in / moved.read_s
        return replace(self, write_bytes_per_s=write, read_bytes_per_s=read)

    def step_s(self, trace: Trace, plan: Plan) -> float:
        """The predicted wall time of a step of ``trace`` replaying ``plan``."""
        compute = sum(s.duration_s for s in trace.steps)
        stalls = predict_stalls(plan, trace, self.write_bytes_per_s, self.read_bytes_per_s)
        return compute + sum(stalls) + self.swap_cpu_s_per_byte * moved_bytes(plan, trace)

    def corrected(self, plan: Plan, trace: Trace, measured_s: float) -> "Costs":
        """The per-byte CPU cost that explains ``measured_s``; unchanged if nothing moves."""
        moved = moved_bytes(plan, trace)
        if moved == 0:
            return self
        residual = measured_s - self.step_s(trace, plan)
        per_byte = max(0.0, self.swap_cpu_s_per_byte + residual / moved)
        return replace(self, swap_cpu_s_per_byte=per_byte)


DEFAULT_COSTS = Costs()


def moved_bytes(plan: Plan, trace: Trace) -> int:
    """Bytes a replay of ``plan`` writes and reads per step."""
    written = sum(m.evict_bytes for m in writing_moves(plan, trace))
    read = sum(m.evict_bytes for m in plan.moves if m.prefetch_step < len(trace.steps))
    return written + read


def recompute_s(trace: Trace, names: tuple[str, ...]) -> float:
    """What recomputing the units ``names`` of ``trace`` costs a step."""
    units = {u.name: u for u in trace.units}
    return sum(whole_s(units[n]) for n in names)


def misses(predicted_s: float, measured_s: float) -> bool:
    """Whether a replay's ``measured_s`` misses ``predicted_s`` by more than the tolerance."""
    return abs(measured_s - predicted_s) > TIME_TOLERANCE * max(predicted_s, 1e-9)
