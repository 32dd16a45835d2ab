"""One profiled iteration as plain data: steps, saved tensors, durations, the live-bytes curve."""

import dataclasses
import json
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

TRACE_SCHEMA_VERSION = 18


class TensorKind(StrEnum):
    """What a trace tensor is: a saved activation, or a tensor of parameter offloading."""

    ACTIVATION = "activation"  # saved for backward by autograd
    PARAM = "param"  # a parameter (NOTE [one plan] in offload/joint.py)
    GRAD = "grad"  # a parameter's gradient, kept for an update or an accumulation
    STATE = "state"  # an optimizer state tensor


class Phase(StrEnum):
    """Which pass a step belongs to."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OTHER = "other"  # after backward until the end of the managed iteration (optimizer, logging)


@dataclass(frozen=True)
class TraceStep:
    """One layer of the Layered Graph Model: the execution between two module boundaries.

    Attributes:
        name: ``forward:<module>``, ``backward:<module>`` or ``other:<what>``.
        live_bytes_start, peak_live_bytes: tracked device bytes at its start, and the most sampled.
        unmanaged_peak_bytes: the most tracked bytes outside managed vTensors, plus
            ``transient_bytes`` (op workspaces beyond the sampled peak) where counted.
        growth_bytes: per hook event, how far the bytes rose after the guard acted there
            (NOTE [step reserve]); trailing zeros left out.
        part_peak_bytes, part_base_bytes: a backward step's unmanaged peak and first sample per
            part (NOTE [backward parts]); empty where the step is one part.
    """

    index: int
    name: str
    phase: Phase
    duration_s: float
    live_bytes_start: int
    peak_live_bytes: int
    unmanaged_peak_bytes: int
    transient_bytes: int = 0
    growth_bytes: tuple[int, ...] = ()
    part_peak_bytes: tuple[int, ...] = ()
    part_base_bytes: tuple[int, ...] = ()


@dataclass(frozen=True)
class TraceTensor:
    """One saved storage (all the views autograd saved of it).

    Attributes:
        vid: identity, in order of first save.
        evictable_step: the first step at whose start only autograd referenced it; -1 if never.
        use_steps: step indices at which backward unpacked it, in order.
        name: a parameter-side tensor's name (``"fc.weight#state:exp_avg"``); empty for
            activations, matched by position.
        persistent: it outlives the iteration (parameters, optimizer state, kept gradients).
        whole: it moves as one piece whatever the chunk size (parameter-side tensors).
        dirty_step: the last step that changed it (an update, an accumulation), -1 if none.
        last_part: the part of its last use step where it was last unpacked; -1: one part.
    """

    vid: int
    nbytes: int
    dtypes: tuple[str, ...]
    saved_step: int
    evictable_step: int
    use_steps: tuple[int, ...]
    kind: TensorKind = TensorKind.ACTIVATION
    name: str = ""
    persistent: bool = False
    whole: bool = False
    dirty_step: int = -1
    last_part: int = -1


@dataclass(frozen=True)
class TraceUnit:
    """A module whose forward the manager could run again in backward (NOTE [recompute]).

    Attributes:
        first_step, last_step: the first and last forward steps of its forward.
        forward_s: wall time of its forward run again on its own (NOTE [unit time]).
        inner_vids: vTensors saved inside its forward and used only by its own backward: the
            bytes recomputing it would not keep.
        input_vids: vTensors saved inside its forward that are its inputs: recomputed, it holds
            them from its forward to its backward.
        safe, why_unsafe: whether running it again is exact (NOTE [safe to recompute]).
        working_bytes: the most its forward held of what it made (NOTE [recomputation's working
            set]).
        overhead_s: checkpointing's own work beyond the forward (NOTE [mechanism cost]).
    """

    name: str
    first_step: int
    last_step: int
    forward_s: float
    inner_vids: tuple[int, ...]
    input_vids: tuple[int, ...]
    safe: bool
    why_unsafe: str = ""
    working_bytes: int = 0
    overhead_s: float = 0.0


@dataclass(frozen=True)
class Trace:
    """A profiled iteration, the input of the planner.

    Attributes:
        unmanaged_saved_bytes: bytes saved for backward that stay resident (parameters, tiny).
        baseline_bytes: tracked device bytes at the start (parameters, gradients, state, inputs).
        chunk_bytes: chunk size (None: whole tensors).
        incomplete: not a steady-state iteration (its first update created optimizer state).
        units: the modules that could be recomputed, outermost first.
        recomputed: the modules recomputed while this iteration ran.
        encoded: its clamps saved their output, not their input (NOTE [mask encoding]).
    """

    steps: tuple[TraceStep, ...]
    tensors: tuple[TraceTensor, ...]
    unmanaged_saved_bytes: int
    baseline_bytes: int
    budget_bytes: int
    chunk_bytes: int | None
    device: str
    schema_version: int = TRACE_SCHEMA_VERSION
    incomplete: bool = False
    units: tuple[TraceUnit, ...] = ()
    recomputed: tuple[str, ...] = ()
    encoded: bool = False

    def holding(self, state_bytes: int) -> "Trace":
        """This iteration as it would run with ``state_bytes`` more held throughout.

        NOTE [state to come]: a first iteration runs before the optimizer's state exists, which
        every later one holds throughout; planned without it, every replay would evict.
        """
        if state_bytes == 0:
            return self
        steps = tuple(
            dataclasses.replace(
                s,
                live_bytes_start=s.live_bytes_start + state_bytes,
                peak_live_bytes=s.peak_live_bytes + state_bytes,
                unmanaged_peak_bytes=s.unmanaged_peak_bytes + state_bytes,
                part_peak_bytes=tuple(p + state_bytes for p in s.part_peak_bytes),
                part_base_bytes=tuple(b + state_bytes for b in s.part_base_bytes),
            )
            for s in self.steps
        )
        return dataclasses.replace(
            self, steps=steps, baseline_bytes=self.baseline_bytes + state_bytes
        )

    def to_json(self) -> str:
        """JSON text, built field by field: ``asdict`` deep-copies every leaf, slow here."""
        plain = shallow(self)
        for name in ("steps", "tensors", "units"):
            plain[name] = [shallow(item) for item in plain[name]]
        return json.dumps(plain, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Trace":
        """Parse the output of :meth:`to_json`."""
        raw: dict[str, Any] = json.loads(text)
        if raw.get("schema_version") != TRACE_SCHEMA_VERSION:
            raise ValueError(
                f"trace schema_version {raw.get('schema_version')!r} is not "
                f"{TRACE_SCHEMA_VERSION}; re-profile the model"
            )
        steps = tuple(
            TraceStep(**{**tuples_in(s), "phase": Phase(s["phase"])}) for s in raw.pop("steps")
        )
        tensors = tuple(
            TraceTensor(**{**tuples_in(t), "kind": TensorKind(t["kind"])})
            for t in raw.pop("tensors")
        )
        units = tuple(TraceUnit(**tuples_in(u)) for u in raw.pop("units", ()))
        return cls(steps=steps, tensors=tensors, units=units, **tuples_in(raw))


def tuples_in(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with its JSON lists (nested ones too) as the tuples the dataclasses hold."""
    return {name: _tuple(value) for name, value in raw.items()}


def _tuple(value: Any) -> Any:
    return tuple(_tuple(v) for v in value) if isinstance(value, list) else value


def shallow(item: Any) -> dict[str, Any]:
    """A dataclass of plain leaves as a dict, its leaves not copied."""
    return {f.name: getattr(item, f.name) for f in fields(item)}
