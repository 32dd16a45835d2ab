"""A trace as it would be with modules recomputed: the model the choice of them judges (pure)."""

import dataclasses
from collections.abc import Sequence

from vtensor.planner.trace import Trace, TraceStep, TraceUnit


def whole_s(unit: TraceUnit) -> float:
    """What recomputing ``unit`` costs: its forward and checkpointing's own work."""
    return unit.forward_s + unit.overhead_s


def with_recompute(trace: Trace, names: Sequence[str]) -> Trace:
    """What ``trace`` would be with the units ``names`` recomputed (a model, for choosing).

    Inner tensors are gone, what recomputation brings back is unmanaged, inputs cannot move
    (checkpointing's frame holds them); vids are renumbered in order.

    NOTE [recomputed lifetimes]: a unit runs again at the first unpack of anything it saved, so
    all it brings back appears at the start of its backward; torch's checkpoint drops each at its
    unpack, so each is freed in the part that used it last (NOTE [backward parts]).
    """
    chosen = set(names)
    units = [u for u in trace.units if u.name in chosen]
    gone = {v for u in units for v in u.inner_vids}
    kept = {v for u in units for v in u.input_vids}
    extra = [0] * len(trace.steps)
    part_extra: dict[int, list[int]] = {}  # by step, per part: tensors freed in a part
    for unit in units:
        backward = [s.index for s in trace.steps if in_backward(s.name, unit.name)]
        first, last = min(backward, default=unit.last_step), max(backward, default=unit.last_step)
        for v in unit.inner_vids:  # NOTE [recomputed lifetimes]
            tensor = trace.tensors[v]
            freed = max((s for s in tensor.use_steps if s >= first), default=last)
            for index in range(first, freed):
                extra[index] += tensor.nbytes
            parts = len(trace.steps[freed].part_peak_bytes)
            if freed == max(tensor.use_steps, default=-1) and 0 <= tensor.last_part < parts:
                by_part = part_extra.setdefault(freed, [0] * parts)
                for j in range(tensor.last_part + 1):
                    by_part[j] += tensor.nbytes
            else:
                extra[freed] += tensor.nbytes
        _add_working(trace, unit, first, extra, part_extra)
    steps = tuple(_with_extra(s, extra[s.index], part_extra.get(s.index)) for s in trace.steps)
    tensors = tuple(
        dataclasses.replace(t, vid=i, evictable_step=-1 if t.vid in kept else t.evictable_step)
        for i, t in enumerate(t for t in trace.tensors if t.vid not in gone)
    )
    return dataclasses.replace(trace, steps=steps, tensors=tensors, units=(), recomputed=())


def _add_working(
    trace: Trace,
    unit: TraceUnit,
    first: int,
    extra: list[int],
    part_extra: dict[int, list[int]],
) -> None:
    """Hold the working set ``unit`` runs again with, less what it brings back (held already).

    NOTE [working set at an unpack]: a recomputation runs inside the unpack that begins a part
    and lets go of its temporaries before the part's node allocates, so the part peaks at the
    larger of the two, not their sum: it holds what the working set adds above the highest base
    of the parts it may run in, beyond the part's own peak. Without bases it is held on top.
    """
    held = sum(trace.tensors[v].nbytes for v in unit.inner_vids)
    more = unit.working_bytes - held
    if more <= 0:
        return
    saved = [trace.tensors[v] for v in (*unit.inner_vids, *unit.input_vids)]
    at = min((s for t in saved for s in t.use_steps if s >= first), default=first)
    parts = len(trace.steps[at].part_peak_bytes)
    if not parts:
        extra[at] += more
        return
    ended = [t.last_part for t in saved if max(t.use_steps, default=-1) == at and t.last_part >= 0]
    last = min([*ended, parts - 1])
    by_part = part_extra.setdefault(at, [0] * parts)
    step = trace.steps[at]
    start = max(step.part_base_bytes[: last + 1], default=-1)
    for j in range(last + 1):
        if start < 0:  # no part's base known: held on top of the part's own peak
            by_part[j] += more
        else:
            by_part[j] += max(0, min(more, start + more - step.part_peak_bytes[j]))


def _with_extra(step: TraceStep, extra: int, part_extra: list[int] | None) -> TraceStep:
    """``step`` holding ``extra`` more throughout and ``part_extra`` more in each of its parts."""
    if part_extra is None:
        parts = tuple(p + extra for p in step.part_peak_bytes)
        return dataclasses.replace(
            step, unmanaged_peak_bytes=step.unmanaged_peak_bytes + extra, part_peak_bytes=parts
        )
    parts = tuple(p + extra + e for p, e in zip(step.part_peak_bytes, part_extra, strict=True))
    return dataclasses.replace(step, unmanaged_peak_bytes=max(parts), part_peak_bytes=parts)


def in_backward(step: str, unit: str) -> bool:
    """Whether ``step`` is a backward step of module ``unit`` or one inside it."""
    return step == f"backward:{unit}" or step.startswith(f"backward:{unit}.")
