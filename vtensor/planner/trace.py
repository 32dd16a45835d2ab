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
        index: position in execution order.
        name: ``forward:<module>``, ``backward:<module>`` or ``other:<what>``.
        phase: forward, backward or other.
        duration_s: measured wall time of the step.
        live_bytes_start: tracked device bytes when the step began.
        peak_live_bytes: largest tracked device bytes sampled during the step.
        unmanaged_peak_bytes: largest tracked device bytes sampled during the step that were not
            in managed vTensors (parameters, gradients, outputs not saved yet, temporaries),
            plus ``transient_bytes`` when the manager counts op workspaces.
        transient_bytes: what the step needed beyond its sampled peak, for workspaces that live
            only inside one op (measured from the process's RSS high-water mark on CPU; 0 where
            it could not be measured).
        growth_bytes: per hook event of the step (0: its start, then each saved-tensor pack,
            unpack and backward node, in order), how far the tracked bytes rose after the guard
            acted there before it could act again, less the manager's own restores, parameter
            reads and recomputations (NOTE [step reserve] in ``planner/reserves.py``); 0 where
            it did not act; trailing events without a rise left out.
        part_peak_bytes: a backward step's unmanaged peak per part, in order: a part begins
            at the first unpack after a backward node ended (NOTE [backward parts] in
            ``planner/memory_model.py``); empty where the step is one part.
        part_base_bytes: per part, its first unmanaged sample, taken at the unpack that began
            it, before the part's backward node allocates: where a recomputation run at that
            unpack starts from (``_add_working`` in ``planner/recomputed.py``); empty where the
            step is one part.
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
        nbytes: size of its storage.
        dtypes: dtypes of the views saved of it.
        saved_step: step index of the first save.
        evictable_step: first step at whose start nothing but autograd referenced it (it could
            be swapped from then on: the step after the one during which that became true);
            -1 if that never happened.
        use_steps: step indices at which backward unpacked it, in order.
        kind: a saved activation, or a tensor of parameter offloading (NOTE [one plan] in
            ``offload/joint.py``).
        name: a parameter-side tensor's name in its ``ParamOffload``
            (``"fc.weight#state:exp_avg"``); empty for activations, matched by position instead.
        persistent: it outlives the iteration (parameters, optimizer state, gradients kept
            for an update after it): live through the last step. One that also existed before
            it (``saved_step`` 0) is away at the start of an iteration if a plan has it away at
            the end (NOTE [memory model] in memory_model.py).
        whole: it moves as one piece whatever the chunk size (parameter-side tensors).
        dirty_step: the last step at which it was changed (an update, an accumulation), -1 if
            it was not: an eviction before that step and after a write-back needs no write.
        last_part: the part of its last use step (``TraceStep.part_peak_bytes``) in which it
            was last unpacked; -1 where that step is one part or it is not known.
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
        name: the module's qualified name in the model.
        first_step: index of the forward step its forward began with.
        last_step: index of the last forward step inside its forward.
        forward_s: measured wall time of its forward run again on its own (what recomputing it
            costs, with ``overhead_s``: NOTE [unit time] in
            ``activations/recompute/profile/units.py``).
        inner_vids: the vTensors (trace vids) saved inside its forward, made there and used
            only by its own backward steps: the bytes recomputing it would not keep.
        input_vids: vTensors saved inside its forward that are its inputs: a recomputed unit
            holds them from its forward to its backward, where no swap can take them.
        safe: its forward reproduced its outputs bit for bit when run again, and it modified no
            input in place, called no custom autograd Function and changed no module attribute
            (NOTE [safe to recompute]); an unsafe unit is never recomputed.
        why_unsafe: the first reason it is not safe ("" when safe).
        working_bytes: how far its forward took the bytes it made, the tensors it saved
            included: what running it again holds at its peak (NOTE [recomputation's working
            set] in ``activations/runtime/recorder.py``).
        overhead_s: what recomputing it costs beyond its forward: torch's checkpointing's
            own work, measured once per process (NOTE [mechanism cost] in
            ``activations/recompute/profile/cost.py``).
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
        steps: the steps in execution order.
        tensors: the saved storages the manager could move.
        unmanaged_saved_bytes: bytes saved for backward that stay resident (parameters, tiny).
        baseline_bytes: tracked device bytes at the start (parameters, gradients, state, inputs).
        budget_bytes: the budget the iteration ran under.
        chunk_bytes: chunk size (None: whole tensors).
        device: device type, "cpu" or "cuda".
        schema_version: bumped when fields change meaning.
        incomplete: not a steady-state iteration (its first update created optimizer state):
            a plan is made from a later one.
        units: the modules that could be recomputed, outermost first (profiled with
            ``recompute=True`` only; empty otherwise).
        recomputed: the modules recomputed while this iteration ran.
        encoded: its clamps saved bits, not their inputs (NOTE [mask encoding]).
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

        NOTE [state to come]
        A model's first iteration runs before its first update makes the optimizer's state
        (momentum, Adam's moments), which every later iteration holds throughout. Its trace is
        planned as those iterations will run, with that state added to every step, as the
        stated minimum adds it. A plan short of that state would leave the guard evicting beside
        it at every replay, and a budget between the floor and the floor with the state would
        look feasible only to break when the state appears.
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

    def live_curve(self) -> list[tuple[int, int]]:
        """(step index, peak tracked device bytes) per step."""
        return [(s.index, s.peak_live_bytes) for s in self.steps]

    def to_json(self) -> str:
        """Serialize to JSON text: that of ``dataclasses.asdict``, field by field.

        ``asdict`` deep-copies every leaf, which is slow for a large trace. Steps, tensors and
        units hold only numbers, strings, string enums and tuples of them, which JSON writes the
        same way either way.
        """
        plain = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("steps", "tensors", "units"):
            plain[name] = [_shallow(item) for item in plain[name]]
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
            TraceStep(
                **{
                    **s,
                    "phase": Phase(s["phase"]),
                    "growth_bytes": tuple(s["growth_bytes"]),
                    "part_peak_bytes": tuple(s["part_peak_bytes"]),
                    "part_base_bytes": tuple(s["part_base_bytes"]),
                }
            )
            for s in raw.pop("steps")
        )
        tensors = tuple(
            TraceTensor(
                **{
                    **t,
                    "dtypes": tuple(t["dtypes"]),
                    "use_steps": tuple(t["use_steps"]),
                    "kind": TensorKind(t["kind"]),
                }
            )
            for t in raw.pop("tensors")
        )
        units = tuple(
            TraceUnit(
                **{
                    **u,
                    "inner_vids": tuple(u["inner_vids"]),
                    "input_vids": tuple(u["input_vids"]),
                }
            )
            for u in raw.pop("units", ())
        )
        recomputed = tuple(raw.pop("recomputed", ()))
        return cls(
            steps=steps,
            tensors=tensors,
            units=units,
            recomputed=recomputed,
            **raw,
        )


def _shallow(item: Any) -> dict[str, Any]:
    """A dataclass of plain leaves as a dict, its leaves not copied."""
    return {f.name: getattr(item, f.name) for f in fields(item)}
