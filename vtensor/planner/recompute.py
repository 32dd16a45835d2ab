"""Which modules to recompute instead of keeping or swapping what they save (pure).

NOTE [hybrid plan]
Every saved byte is kept, swapped or recomputed. Recomputing a unit frees its inner tensors from
its forward to its backward at its measured cost (``whole_s``). Two options are priced: the
cheapest cover of the deficit (cheapest per freed byte first, never two nested units, each only
where a feasible floor remains) and every outermost safe unit (checkpointing every block). The
decision prices each, with the swapping left to do, on the calibrated model against swapping
alone.
"""

from collections.abc import Sequence

from vtensor.planner.lgm import build_lgm, min_budget
from vtensor.planner.memory_model import unmanaged_peak
from vtensor.planner.recomputed import whole_s, with_recompute
from vtensor.planner.trace import TensorKind, Trace, TraceUnit

Names = tuple[str, ...]


def inner_bytes(trace: Trace, unit: TraceUnit) -> int:
    """Bytes recomputing ``unit`` would not keep."""
    return sum(trace.tensors[v].nbytes for v in unit.inner_vids)


def unit_regrowth(trace: Trace) -> dict[str, int]:
    """Per safe unit, what recomputing it holds at once.

    NOTE [regrowth bound]: the unit's measured working set (NOTE [recomputation's working set]);
    where none was measured, twice what it saved but its inputs (it also holds unsaved outputs).
    """
    bounds = {}
    for unit in trace.units:
        if unit.safe and unit.working_bytes:
            bounds[unit.name] = unit.working_bytes
        elif unit.safe:
            inputs = set(unit.input_vids)
            inside = sum(
                t.nbytes
                for t in trace.tensors
                if unit.first_step <= t.saved_step <= unit.last_step
                and t.vid not in inputs
                and t.kind is TensorKind.ACTIVATION
            )
            bounds[unit.name] = 2 * inside
    return bounds


def choose_recompute(trace: Trace, budget_bytes: int) -> Names:
    """The cheapest units of ``trace`` to recompute to cover its deficit at ``budget_bytes``."""
    # Against what the iteration would hold if nothing moved (the profiled one already swapped).
    deficit = unmanaged_peak(trace) - budget_bytes
    if deficit <= 0:
        return ()
    options = [(u, whole_s(u), inner_bytes(trace, u)) for u in trace.units if u.safe]
    ranked = sorted((o for o in options if o[2] > 0), key=lambda o: (o[1] / o[2], o[0].name))
    chosen: list[str] = []
    freed = 0
    spent = 0.0
    finishes: list[tuple[float, list[str]]] = []  # NOTE [cheapest finish]
    priced = False
    for unit, seconds, nbytes in ranked:
        if freed >= deficit:
            break
        if not priced:  # what finishing the cover from here costs, once per prefix
            priced = True
            below = min((f[0] for f in finishes), default=float("inf")) - spent
            finish = _cheapest_finish(trace, budget_bytes, ranked, chosen, deficit - freed, below)
            if finish is not None:
                finishes.append((spent + finish[0], [*chosen, finish[1]]))
        if any(_nested(unit.name, other) for other in chosen):
            continue  # nested in a chosen unit
        if not _fits(with_recompute(trace, [*chosen, unit.name]), budget_bytes):
            continue  # its working set in backward would not fit
        chosen.append(unit.name)
        freed += nbytes
        spent += seconds
        priced = False
    if freed >= deficit:
        finishes.append((spent, chosen))
    if finishes:
        _, chosen = min(finishes, key=lambda f: f[0])  # the first of equals
    return tuple(sorted(chosen))


def _cheapest_finish(
    trace: Trace,
    budget_bytes: int,
    options: Sequence[tuple[TraceUnit, float, int]],
    chosen: Sequence[str],
    left: int,
    below: float,
) -> tuple[float, str] | None:
    """The option of least time, under ``below``, that alone frees ``left`` more bytes.

    NOTE [cheapest finish]: cheapest per freed byte first can overshoot, so at every point of the
    ratio order the cheapest unit that finishes the cover alone is priced too (greedy covering's
    classic guard). A finish counts only where the iteration then peaks within the budget.
    """
    for unit, seconds, _ in sorted((o for o in options if o[2] >= left), key=lambda o: o[1]):
        if seconds >= below:
            return None  # no cheaper than a finish already priced
        if any(_nested(unit.name, other) for other in chosen):
            continue
        if unmanaged_peak(with_recompute(trace, [*chosen, unit.name])) <= budget_bytes:
            return seconds, unit.name
    return None


def recompute_outermost(trace: Trace, budget_bytes: int) -> Names:
    """Every outermost safe unit of ``trace`` (checkpointing every block).

    A unit that would leave no feasible floor gives way to its outermost safe descendants.
    """
    safe = sorted((u for u in trace.units if u.safe), key=lambda u: u.name)
    frontier = _outermost(safe)
    chosen: list[str] = []
    while frontier:
        unit = frontier.pop(0)
        if _fits(with_recompute(trace, [*chosen, unit.name]), budget_bytes):
            chosen.append(unit.name)
        else:
            frontier += _outermost([u for u in safe if _inside(u.name, unit.name)])
    return tuple(sorted(chosen))


def recompute_candidates(trace: Trace, budget_bytes: int) -> tuple[Names, ...]:
    """The recomputations worth pricing at ``budget_bytes`` (NOTE [hybrid plan]); may be empty."""
    cheapest = choose_recompute(trace, budget_bytes)
    if not cheapest:
        return ()
    every_block = recompute_outermost(trace, budget_bytes)
    return tuple(dict.fromkeys(c for c in (cheapest, every_block) if c))


def _fits(trace: Trace, budget_bytes: int) -> bool:
    """Whether ``trace`` has a feasible floor at ``budget_bytes``."""
    return min_budget(build_lgm(trace, trace.chunk_bytes))[0] <= budget_bytes


def _inside(a: str, b: str) -> bool:
    """Whether module ``a`` is a descendant of module ``b``."""
    return a.startswith(b + ".")


def _outermost(units: Sequence[TraceUnit]) -> list[TraceUnit]:
    """Those of ``units`` inside none of the others, in order."""
    return [u for u in units if not any(_inside(u.name, o.name) for o in units)]


def _nested(a: str, b: str) -> bool:
    return a == b or _inside(a, b) or _inside(b, a)
