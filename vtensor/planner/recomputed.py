"""A trace as it would be with modules recomputed: the model the choice of them judges (pure)."""

import dataclasses
from collections.abc import Sequence

from vtensor.planner.trace import Trace, TraceStep, TraceUnit


def whole_s(unit: TraceUnit) -> float:
    """What recomputing ``unit`` costs: its forward and the mechanism's own work.

    NOTE [mechanism cost] is in ``activations/recompute/profile/cost.py``.
    """
    return unit.forward_s + unit.overhead_s


def with_recompute(trace: Trace, names: Sequence[str]) -> Trace:
    """What ``trace`` would be with the units ``names`` recomputed (a model, for choosing).

    A unit's inner tensors are gone. Each tensor recomputation brings back is held, as
    unmanaged bytes, from the unit's first backward step through its own last use (NOTE
    [recomputed lifetimes]), and while it runs again, that step holds its working set too
    (``_add_working``). The unit's inputs cannot move: checkpointing's frame holds them. Vids
    are renumbered in order.

    NOTE [recomputed lifetimes]
    Recomputation runs the unit's forward again at the first unpack of anything it saved, so
    every tensor it brings back appears at once, at the start of the unit's backward. It does
    not stay there: torch's checkpoint keeps a recomputed tensor only under a weak reference
    keyed by the handle its saved-tensor hook packed, and drops the handle when the tensor is
    unpacked, so each one is freed once the backward node that used it is done with it, within
    its last step in the part that used it last (NOTE [backward parts] in
    ``memory_model.py``).
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
                # Freed in the part that used it last (NOTE [backward parts] in memory_model.py).
                by_part = part_extra.setdefault(freed, [0] * parts)
                for j in range(tensor.last_part + 1):
                    by_part[j] += tensor.nbytes
            else:
                extra[freed] += tensor.nbytes
        _add_working(trace, unit, first, extra, part_extra)
    steps = tuple(_with_extra(s, extra[s.index], part_extra.get(s.index)) for s in trace.steps)
    tensors = tuple(
        dataclasses.replace(
            t,
            vid=i,
            evictable_step=-1 if t.vid in kept else t.evictable_step,
        )
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
    """Hold what ``unit`` runs again with beyond what it brings back, where it runs again.

    NOTE [recomputation's working set] in ``activations/runtime/recorder.py``: the working set less
    the tensors it brings back, which the model holds already. It runs at the first unpack of
    anything the unit saved from ``first``, its first backward step, on: in the step of that use,
    through the earliest part in which one of those tensors was last used there (every part where
    none was).

    NOTE [working set at an unpack]
    A recomputation runs inside the unpack that begins a part, before that part's backward node
    allocates anything, and has let go of its temporaries when the node starts: the part peaks
    at the larger of the two, not at their sum. Held on top of each part's own peak, every
    block of the char GPT recomputed was modelled to need 108.5 MiB at half batch, where the
    trial of that plan peaked at 99.3 MiB and checkpointing the same blocks at 99.1 MiB of live
    tensors (benchmarks/README.md, ``activation_swap``): candidates near a floor were judged
    not to fit. So a part holds what the working set adds above the part's base (its first
    sample, at that unpack), the highest base of the parts it may run in, where that is above
    the part's own peak. Without bases (a step in one part) it is held on top, as before.
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
    # NOTE [working set at an unpack]
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
